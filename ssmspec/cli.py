"""The `ssmspec` command: `demo` (the README's main job), `generate`, `bench` (end-to-end benchmark), `check`
(the equivalence checker, for users' CI) and `train-head` (a draft head for a model, saved beside it).

User mistakes end in one clear line on stderr and exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
EMBEDDED_DEFAULT = "the embedded trained mamba2-target"

# the demo's default prompt: ordinary argument checking, written for the demo (not in the training corpus);
# the embedded 3M-parameter model continues it with more checks of the same shape for about 60 tokens (longer
# continuations drift: it is a tiny model), which is where n-gram drafts pay off
DEMO_PROMPT = """def check_args(name, size, mode):
    if not isinstance(name, str):
        raise TypeError("name must be a string, not %r" % (name,))
    if not isinstance(size, int):
        raise TypeError("size must be an integer, not %r" % (size,))
    if not isinstance(mode, str):
"""
HUB_TIMEOUT_S = 3.0


def quiet_libraries() -> None:
    """The command prints its own results: no library warnings or progress bars in between."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether the Hugging Face hub endpoint answers a TCP connection within `timeout` seconds."""
    import os
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def looks_like_path(name: str) -> bool:
    """Whether `name` is meant as a local path rather than a hub id ("org/name"): absolute, relative to "." or "~",
    an existing file, or not of a hub id's form."""
    import os
    import re

    if name.startswith(("/", ".", "~")) or os.path.exists(name) or os.sep in name.strip("/").replace("/", "", 1):
        return True
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is None


def load_pretrained(name: str, dtype: torch.dtype):
    """(model, tokenizer or None) from a local directory, an embedded model's name (ssmspec.models), the local HF
    cache, or the hub. A path that does not exist is named; a hub id that is not cached fails in one line within
    seconds when the hub cannot be reached (HF would retry for over a minute)."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ssmspec import models

    if not os.path.isdir(name) and name in models.NAMES:  # an embedded model by its name
        name = str(models.path(name))
    local = os.path.isdir(name)
    if not local and looks_like_path(name):
        raise FileNotFoundError(f"no model directory at {name!r}")
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        if local or os.environ.get("HF_HUB_OFFLINE") == "1":
            raise OSError(f"cannot load model {name!r}: {str(exc).splitlines()[0]}") from None
        if not _hub_reachable():
            raise OSError(
                f"model {name!r} is not a local directory or in the Hugging Face cache, and the hub is unreachable "
                "(offline?); pass a local path"
            ) from None
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        except (OSError, ValueError) as exc2:
            raise OSError(f"cannot load model {name!r}: {str(exc2).splitlines()[0]}") from None
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        tok = None
    return model.eval(), tok


def _load(model: str | None, family: str | None, dtype: torch.dtype):
    """(model, tokenizer or None, description): --model path/hub id, --family tiny random model, or the
    embedded trained target."""
    if model:
        m, tok = load_pretrained(model, dtype)
        return m, tok, model
    from ssmspec import models

    if family is None and "mamba2-target" in models.available():
        m, tok = models.load("mamba2-target", dtype)
        bpb = models.report().get("mamba2-target", {}).get("held_out_bits_per_byte")
        extra = f", held-out {bpb:.2f} bits/byte" if bpb else ""
        return m, tok, f"embedded mamba2-target (trained on the Python stdlib{extra})"
    from ssmspec.testing.configs import build_tiny_model

    family = family or "mamba2"
    return (
        build_tiny_model(family, dtype=dtype),
        None,
        f"random-init tiny {family} (no trained weights: tokens are ids)",
    )


def _drafter_of(model, ids: torch.Tensor, spec, kwargs: dict) -> str:
    """The drafter `model.generate(ids, speculation=spec, **kwargs)` drafts with, as its plan chose it, in words."""
    from ssmspec.hf.mtp import MTPModule
    from ssmspec.speculate.plan import plan_call

    call = model._speculative_call(None, None, None, spec)
    chosen = plan_call(model, ids, None, kwargs=dict(kwargs), **call).spec
    head = model.ssmspec_draft_head
    name = f"the {head.family} MTP layer" if isinstance(head, MTPModule) else "the draft head"
    if chosen.drafter in ("draft_head", "mtp"):
        return f"{name} + prompt lookup" if chosen.tree else name
    return "prompt lookup" if chosen.drafter == "prompt_lookup" else chosen.drafter


def cmd_demo(args: argparse.Namespace) -> int:
    """Greedy vs speculative generation on one prompt: text, tokens/s of both, acceptance, identity."""
    import ssmspec
    from ssmspec.bench import best_time

    dtype = DTYPES[args.dtype]
    ref, tok, what = _load(args.model, args.family, dtype)
    model = ssmspec.transform(copy.deepcopy(ref))
    vocab = ref.config.get_text_config().vocab_size
    if tok is not None:
        ids = tok(args.prompt or DEMO_PROMPT, return_tensors="pt")["input_ids"]
    else:
        g = torch.Generator().manual_seed(args.seed)
        motif = torch.randint(3, vocab, (6,), generator=g)
        ids = torch.cat([torch.randint(3, vocab, (4,), generator=g), motif, motif, motif[:3]])[None]
    tree = not args.chain
    spec = ssmspec.SpecConfig(num_draft_tokens=args.draft_tokens, tree=tree, tree_budget=args.tree_budget)
    kwargs = {"max_new_tokens": args.max_new_tokens}
    t_base, base = best_time(lambda: ref.generate(ids, do_sample=False, **kwargs), 3)
    plain = ssmspec.SpecConfig(drafter="none")
    t_ar, ar = best_time(lambda: model.generate(ids, speculation=plain, **kwargs), 3)
    t_spec, out = best_time(lambda: model.generate(ids, speculation=spec, return_dict_in_generate=True, **kwargs), 3)
    new = base.shape[1] - ids.shape[1]
    same = torch.equal(base, out.sequences) and torch.equal(base, ar)
    print(f"model:        {what}")
    if tok is not None:
        print("---- prompt + speculative output " + "-" * 40)
        print(tok.decode(out.sequences[0], skip_special_tokens=True))
        print("-" * 73)
    else:
        print(f"prompt ids:   {ids[0].tolist()}")
        print(f"output ids:   {out.sequences[0, ids.shape[1] :].tolist()}")
    drafter = _drafter_of(model, ids, spec, kwargs)  # (as the call's plan chose it)
    kind = (f"tree, {drafter}, up to {args.tree_budget} nodes, depth {args.draft_tokens}" if tree
            else f"chain, {drafter}, up to {args.draft_tokens} draft tokens")  # fmt: skip
    print(f"HF greedy:    {new / t_base:8.1f} tokens/s")
    print(f"ssmspec AR:   {new / t_ar:8.1f} tokens/s  (same engine without drafts: the fair baseline)")
    print(f"speculative:  {new / t_spec:8.1f} tokens/s  ({t_base / t_spec:.2f}x vs HF greedy, "
          f"{t_ar / t_spec:.2f}x vs ssmspec AR)  [{kind}]")  # fmt: skip
    print(
        f"accepted:     {out.spec_stats['mean_accepted_per_step']:.2f} tokens per verify step "
        f"({out.spec_stats['verify_steps']} steps for {new} tokens)"
    )
    print(f"identical:    {'yes' if same else 'NO'} (speculative and ssmspec AR vs HF greedy)")
    device = "GPU" if next(ref.parameters()).is_cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"measured:     wall time of generate(), best of 3 runs each, {new} new tokens, batch 1, "
          f"{args.dtype}, {device}; drafting and verification included")  # fmt: skip
    return 0 if same else 1


def cmd_check(args: argparse.Namespace) -> int:
    """Run ssmspec.testing.check_model on a model (path / hub id) or a supported family's tiny config, on the
    path transform found for it (its trees and batches where the probe found them exact)."""
    import ssmspec
    from ssmspec.speculate.drafters import PromptLookupDrafter
    from ssmspec.testing.check import check_model
    from ssmspec.testing.drafters import OracleDrafter, RandomDrafter

    dtype = DTYPES[args.dtype]
    ref, _, what = _load(args.model, args.family or "mamba2", dtype)
    vocab = ref.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(args.seed)
    info = ssmspec.transform(copy.deepcopy(ref)).ssmspec_info  # the path, trees and batches the probe found
    prompts = []
    for batch, length in ((1, 7), (3, 11)) if info.batches else ((1, 7), (1, 11)):
        ids = torch.randint(3, vocab, (batch, length), generator=g)
        mask = torch.ones_like(ids)
        if batch > 1:
            mask[1, :3] = 0
            ids[1, :3] = ref.generation_config.pad_token_id or 0
        prompts.append((ids, mask))
    trees = info.trees
    drafters = [
        lambda r: OracleDrafter(r, vocab_size=vocab),
        lambda r: OracleDrafter(r, vocab_size=vocab, right_prefix=2, distractors=2 if trees else 0, seed=args.seed),
        lambda r: RandomDrafter(vocab, seed=args.seed, chain=not trees),
        lambda r: PromptLookupDrafter(2, tree=trees),
    ]
    t0 = time.perf_counter()
    print(f"model: {what} ({args.dtype})")
    exact = "; ".join(f"{k}: {info.limits[k]}" if k in info.limits else k for k in ("trees", "batches"))
    print(f"path: {info.path} ({exact})")
    # one-node steps through the tree path too (every state from ssmspec's ops: strict), then through HF's decode
    # path (generate takes whichever measured faster on the model)
    # (the call users make, `model.generate(ids)` with the model's defaults, and with its steps captured: once)
    certified, not_certified = [], {}
    for decode, label in ((False, "tree path only"), (True, "with HF decode steps")):
        report = check_model(ref, prompts, drafters, max_new_tokens=args.max_new_tokens, decode_single_nodes=decode,
                             default_call=not decode)  # fmt: skip
        print(f"{label}: runs {report.runs}, tokens compared {report.tokens_compared}, tie flips "
              f"{report.tie_flips}, max committed-state diff {report.max_state_diff:.3g}, max plain-logit diff "
              f"{report.max_logit_diff:.3g}")  # fmt: skip
        certified += [f"{c} ({label})" if c.startswith("adversarial") else c for c in report.certified]
        not_certified.update(report.not_certified)
    print("certified: " + "; ".join(certified))
    for what, why in not_certified.items():
        print(f"not certified: {what}: {why}")
    print(f"passed in {time.perf_counter() - t0:.1f}s")
    return 0


def _generate_call(args: argparse.Namespace):
    """`ssmspec generate`'s (and `plan`'s) call: (transformed model, tokenizer, what it is, prompt ids, generate's
    keyword arguments)."""
    import ssmspec

    ref, tok, what = _load(args.model, args.family, DTYPES[args.dtype])
    if tok is None:
        raise ValueError(f"`ssmspec {args.command}` needs a model with a tokenizer (the embedded one, or --model PATH)")
    model = ssmspec.transform(ref)
    ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    kwargs: dict = {"max_new_tokens": args.max_new_tokens, "return_dict_in_generate": True}
    if args.sample:
        kwargs.update(do_sample=True, temperature=1.0 if args.temperature is None else args.temperature,
                      top_p=1.0 if args.top_p is None else args.top_p)  # fmt: skip
    elif args.temperature is not None or args.top_p is not None:
        raise ValueError("--temperature and --top-p shape sampling: add --sample (greedy decoding reads neither)")
    if args.draft:
        from ssmspec import models

        draft = models.load("mamba2-draft", DTYPES[args.dtype])[0] if args.draft == "embedded" else None
        if draft is None:
            draft = load_pretrained(args.draft, DTYPES[args.dtype])[0]
        if args.draft_tokens is not None:
            kwargs["num_assistant_tokens"] = args.draft_tokens
        kwargs["assistant_model"] = draft
    else:  # the default call (its drafter: the model's draft head or MTP layer where small, else n-grams)
        tree = False if args.chain else True if args.tree else None
        kwargs["speculation"] = ssmspec.SpecConfig(num_draft_tokens=args.draft_tokens, tree_budget=args.tree_budget,
                                                   tree=tree)  # fmt: skip
    return model, tok, what, ids, kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    """Speculative generation from a prompt; prints the continuation (stats, and with --explain the call's plan, on
    stderr)."""
    import ssmspec

    model, tok, what, ids, kwargs = _generate_call(args)
    if args.explain:
        print(ssmspec.explain(model, ids, **kwargs), file=sys.stderr)
    out = model.generate(ids, **kwargs)
    print(tok.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True))
    stats = out.spec_stats
    print(f"[{what}: {stats['emitted_tokens']} tokens in {stats['verify_steps']} verify steps, "
          f"{stats['mean_accepted_per_step']:.2f} per step]", file=sys.stderr)  # fmt: skip
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """The plan `ssmspec generate` with the same arguments would run, and why, without generating."""
    import ssmspec

    model, _, _, ids, kwargs = _generate_call(args)
    print(ssmspec.explain(model, ids, **kwargs))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """The end-to-end benchmark on the embedded target (ssmspec.bench)."""
    from ssmspec.bench import refuse_unused_options, report, report_batched, run, run_batched, run_sampling

    refuse_unused_options(args)
    if args.batch:
        report_batched(run_batched(args, progress=not args.no_progress), args)
        return 0
    result = run(args, progress=not args.no_progress)
    if args.sampling:
        result["sampling"] = run_sampling(args, progress=not args.no_progress)
    report(result, args)
    return 0


def cmd_train_head(args: argparse.Namespace) -> int:
    """Train a draft head for a local checkpoint on text files and save it beside the checkpoint (or in --out),
    where `ssmspec.transform` finds it."""
    from pathlib import Path

    from ssmspec.speculate.head_training import train_head

    if not Path(args.model).is_dir() and looks_like_path(args.model):
        raise FileNotFoundError(f"no model directory at {args.model!r}")
    if args.out is None and not Path(args.model).is_dir():
        raise ValueError(f"{args.model!r} is not a local directory: pass --out (where to save the head)")
    files = [Path(f) for f in args.files]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"no such training file: {', '.join(missing)}")
    model, tok = load_pretrained(args.model, torch.float32)
    if tok is None:
        raise ValueError(f"{args.model} has no tokenizer: train-head reads text files")
    texts = (tok(f.read_text(errors="replace"), add_special_tokens=False).input_ids for f in files)
    head = train_head(model, texts, steps=args.steps, max_tokens=args.tokens, seq_len=args.seq_len,
                      progress=not args.no_progress)  # fmt: skip
    out = head.save(args.out or args.model, trained_on=f"{len(files)} files", **head.trained)
    print(f"draft head saved in {out} (loss {head.trained['final_loss']:.3f} after {args.steps} steps, "
          f"{head.trained['positions']} positions, {head.trained['seconds']} s)")  # fmt: skip
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line (the command and the error; `--help` shows the usage),
    exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `ssmspec` command."""
    from ssmspec.bench import add_arguments, positive
    from ssmspec.testing.configs import GENERIC_FAMILIES, SUPPORTED_FAMILIES

    parser = _Parser(prog="ssmspec", description="Exact speculative decoding for SSM / hybrid LMs")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(
        p: argparse.ArgumentParser, dtype: str, max_new_tokens: int, default_model: str = EMBEDDED_DEFAULT
    ) -> argparse.ArgumentParser:
        which = p.add_mutually_exclusive_group()  # (one model: a checkpoint or a tiny family's)
        which.add_argument("--model", help=f"local path or hub id of a causal LM (default: {default_model})")
        which.add_argument(
            "--family",
            choices=SUPPORTED_FAMILIES + GENERIC_FAMILIES,
            help="instead: a random-init tiny model of this family",
        )
        p.add_argument("--dtype", default=dtype, choices=sorted(DTYPES))
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-new-tokens", type=positive, default=max_new_tokens)
        return p

    demo = common(sub.add_parser("demo", help="greedy vs speculative on one prompt"), "float32", 64)
    demo.add_argument("--draft-tokens", type=positive, default=8, help="draft depth")
    demo.add_argument("--tree-budget", type=positive, default=16, help="drafted nodes per step (tree)")
    demo.add_argument("--prompt", help="prompt text (with a tokenizer); default: a snippet of Python code")
    demo.add_argument("--chain", action="store_true", help="chain speculation instead of a tree")
    demo.set_defaults(func=cmd_demo)
    check = common(
        sub.add_parser("check", help="equivalence check (speculative == HF greedy)"), "float64", 12,
        default_model="a random-init tiny mamba2",
    )  # fmt: skip
    check.set_defaults(func=cmd_check)
    for name, about in (("generate", "speculative generation from a prompt"),
                        ("plan", "print the plan a generate call would run, and why, without running it")):  # fmt: skip
        gen = common(sub.add_parser(name, help=about), "float32", 64)
        gen.add_argument("prompt")
        gen.add_argument("--draft-tokens", type=positive, help="draft depth at most (default: the default call's)")
        gen.add_argument("--tree-budget", type=positive, help="drafted nodes per step (default: the default call's)")
        shape = gen.add_mutually_exclusive_group()
        shape.add_argument("--tree", action="store_true", help="draft trees (default where the model verifies them)")
        shape.add_argument("--chain", action="store_true", help="draft chains instead of trees")
        gen.add_argument("--draft", help="draft model: 'embedded' (mamba2-draft) or a path / hub id")
        gen.add_argument("--sample", action="store_true", help="sample (lossless) instead of greedy decoding")
        gen.add_argument("--temperature", type=float, help="with --sample (default 1.0)")
        gen.add_argument("--top-p", type=float, help="with --sample (default 1.0: off)")
        if name == "generate":
            gen.add_argument("--explain", action="store_true", help="print the call's plan on stderr first")
        gen.set_defaults(func=cmd_generate if name == "generate" else cmd_plan)

    bench = add_arguments(sub.add_parser("bench", help="end-to-end tokens/s on held-out code (embedded target)"))
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(func=cmd_bench)
    head = sub.add_parser("train-head", help="train a draft head for a model on text files, saved beside it")
    head.add_argument("--model", required=True, help="local checkpoint directory (the head is saved there)")
    head.add_argument("files", nargs="+", help="text files to train on (the kind of text the model will write)")
    head.add_argument("--out", help="save the head here instead of beside the checkpoint")
    head.add_argument("--steps", type=positive, default=3000)
    head.add_argument("--tokens", type=positive, default=500_000, help="training positions at most")
    head.add_argument("--seq-len", type=positive, default=256)
    head.add_argument("--no-progress", action="store_true")
    head.set_defaults(func=cmd_train_head)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    from ssmspec.errors import SSMSpecError
    from ssmspec.testing.check import EquivalenceError

    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        return args.func(args)
    except EquivalenceError as exc:
        print(f"ssmspec: check FAILED: {exc}", file=sys.stderr)
        return 1
    except (SSMSpecError, ValueError, OSError, NotImplementedError) as exc:
        print(f"ssmspec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
