"""One process of `test_tensor_parallel.py`'s run under torchrun (not a test module): loads each tiny checkpoint of
argv[2:] with transformers' tensor parallelism (`tp_plan="auto"`, gloo on CPU) and once whole, generates with HF and
with ssmspec, and rank 0 writes what it saw to argv[1] (JSON)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import ssmspec
from ssmspec.errors import UnsupportedModelError, UnsupportedSettingError
from ssmspec.speculate.drafters.head import DraftHead

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
torch.set_num_threads(1)


def load(path: Path, **kwargs) -> transformers.PreTrainedModel:
    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, config.architectures[0]).from_pretrained(path, dtype=torch.float64, **kwargs)
    model.generation_config.eos_token_id = None  # the full length: more steps to diverge in
    if hasattr(model, "set_experts_implementation"):  # grouped_mm takes no float64
        model.set_experts_implementation("eager")
    return model


def same_on_every_process(t: torch.Tensor) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


def main() -> None:
    out, rank, report = Path(sys.argv[1]), int(os.environ["RANK"]), {}
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 8],
                        [0, 0, 0, 0, 11, 12, 13, 11, 12, 13, 11, 12, 13, 14, 11, 12]])  # fmt: skip
    kwargs = dict(attention_mask=(ids != 0).long(), max_new_tokens=40, do_sample=False, pad_token_id=0)
    for path in map(Path, sys.argv[2:]):
        if path.name.startswith("mtp_"):  # a checkpoint with MTP tensors: the layer drafts beside the sharded target
            report[path.name] = mtp_row(path, ids, kwargs)
            continue
        sharded, whole = load(path, tp_plan="auto"), load(path)
        row: dict = {"tp_size": sharded.tp_size, "sharded_params": any(type(p).__name__ == "DTensor"
                                                                        for p in sharded.parameters())}  # fmt: skip
        hf = sharded.generate(ids, **kwargs)
        row["hf_sharded_equals_whole"] = bool(torch.equal(hf, whole.generate(ids, **kwargs)))
        target = ssmspec.transform(sharded)
        configs = {
            "default": None,
            "tree": ssmspec.SpecConfig(adaptive=False, tree_budget=6, num_draft_tokens=3),
            "chain": ssmspec.SpecConfig(adaptive=False, tree=False, num_draft_tokens=3),
        }
        for name, spec in configs.items():
            got = target.generate(ids, **kwargs, speculation=spec, return_dict_in_generate=True)
            row[name] = {"equal": bool(torch.equal(got.sequences, hf)), "accepted": got.spec_stats["accepted_tokens"]}
        # sampling: every process draws the same tokens from the same seed
        sampled = target.generate(ids, **{**kwargs, "do_sample": True}, generator=torch.Generator().manual_seed(0))
        row["sampled_same_on_every_process"] = same_on_every_process(sampled)
        torch.manual_seed(7)  # the global random state, alike on every process
        row["global_seed_same_on_every_process"] = same_on_every_process(
            target.generate(ids, **{**kwargs, "do_sample": True})
        )
        rank_ids = ids.clone()
        rank_ids[0, -1] += rank  # another prompt on each process
        for name, call in {
            "different_prompts": lambda: target.generate(rank_ids, **kwargs),
            "different_seeds": lambda: (torch.manual_seed(rank), target.generate(ids, **{**kwargs, "do_sample": True})),
        }.items():
            try:
                call()
                row[name] = "ran"
            except ValueError as e:
                row[name] = f"refused: {e}"
        try:
            target.generate(ids, **kwargs, speculation=ssmspec.SpecConfig(ahead=2))
            row["ahead"] = "ran"
        except UnsupportedSettingError as e:
            row["ahead"] = f"refused: {e.setting}"
        try:
            target.compile()
            row["compile"] = "ran"
        except UnsupportedModelError as e:
            row["compile"] = f"refused: {e}"
        if path.name == "qwen3_next":  # a draft head: its embedding and LM head calls are collectives too
            torch.manual_seed(0)
            headed = ssmspec.transform(load(path, tp_plan="auto"), draft_head=DraftHead.for_model(sharded))
            spec = ssmspec.SpecConfig(drafter="draft_head", adaptive=False, tree_budget=6, num_draft_tokens=3)
            got = headed.generate(ids, **kwargs, speculation=spec, return_dict_in_generate=True)
            calls = got.spec_stats["drafter"]["head_calls"]
            row["head"] = {"equal": bool(torch.equal(got.sequences, hf)), "calls": calls}
        report[path.name] = row
    if rank == 0:
        out.write_text(json.dumps(report))
    dist.barrier()


def mtp_row(path: Path, ids: torch.Tensor, kwargs: dict) -> dict:
    """The MTP layer of a sharded model's checkpoint (replicated on every process, fed the target's gathered
    features, through its sharded embedding and LM head): chains and trees against HF's generate on the same sharded
    model, and sampling alike on every process."""
    sharded = load(path, tp_plan="auto")
    hf = sharded.generate(ids, **kwargs)
    target = ssmspec.transform(sharded)
    row: dict = {"tp_size": sharded.tp_size, "mtp": type(target.__dict__.get("ssmspec_draft_head")).__name__}
    for name, tree in (("mtp_tree", True), ("mtp_chain", False)):
        spec = ssmspec.SpecConfig(drafter="mtp", tree=tree, adaptive=False, tree_budget=6, num_draft_tokens=3)
        got = target.generate(ids, **kwargs, speculation=spec, return_dict_in_generate=True)
        row[name] = {"equal": bool(torch.equal(got.sequences, hf)), "calls": got.spec_stats["drafter"]["head_calls"]}
    spec = ssmspec.SpecConfig(drafter="mtp", adaptive=False, tree_budget=6, num_draft_tokens=3)
    sampled = target.generate(ids, **{**kwargs, "do_sample": True}, speculation=spec,
                              generator=torch.Generator().manual_seed(0))  # fmt: skip
    row["mtp_sampled_same_on_every_process"] = same_on_every_process(sampled)
    return row


if __name__ == "__main__":
    main()
