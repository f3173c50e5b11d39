"""The comparison a CPU user makes: llama.cpp beside HF and ssmspec on the embedded models, side by side in one run.

llama.cpp is built from the llama-cpp-python source distribution (its vendored llama.cpp, GGML_NATIVE; about ten
minutes on 2 cores, once: kept under --work), the embedded models are converted to GGUF with its
`convert_hf_to_gguf.py` (two fixes applied to the converter first: the project's byte-level BPE pre-tokenizer mapped
to gpt-2's, and Bamba's partial rotary embedding permuted over the rotated part of each head only; without them
llama.cpp tokenizes differently, or leaves HF's output at the second token), and its greedy tokens are checked
against HF's on every prompt before anything is timed. Then, per model, on held-out prompts: HF's generate, ssmspec's
plain decoding and default call eager, and after `ssmspec.transform(model, compile=True)` (its warm-up timed) the
same two compiled; llama.cpp's decoding through its Python bindings on the same prompts, and llama-bench's tg128
(run once a round between the other methods' calls: this machine's speed moves by tens of percent for seconds at a
time, and one run of it alone read 0.6x or 1.6x the bindings' rate). Every output is compared with HF greedy.
Reported per method: tokens/s of whole calls (the prompt processed, the new tokens generated), and the decoding rate
after the prompt (a call of one new token subtracted), the rate llama-bench's generation test measures. Also the
compiled model's warm-up in a fresh process, with an empty Inductor cache and again with the cache that run left
(`--cold-start`).

    python benchmarks/llamacpp.py [--models mamba2-target bamba-hybrid] [--json docs/data/llamacpp.json]

Optional, not in CI. Needs cmake, a C++ compiler and network access for the source distribution (or --work holding a
build made before).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from _timing import provenance

import ssmspec
from ssmspec import models
from ssmspec.bench import best_time, held_out_prompts, write_json
from ssmspec.speculate.ties import near_ties

LLAMA_CPP_PYTHON = "0.3.36"
# the embedded tokenizer's pre-tokenizer (HF tokenizers' ByteLevel with its regex) as llama.cpp's converter hashes it
TOKENIZER_HASH = "b17747d19b24b4a31dcf3f74bff96a2d817c4599234882744e9b76f2c1f9a483"
# a first difference from HF's greedy tokens is allowed only where HF's top-2 logits are this close (relative to
# max(1, |top logit|)): `ssmspec check`'s float32 near-tie rule
TIE = 1e-3
# llama-bench's generation test repetitions per run (one run a round, beside the other methods' calls)
BENCH_REPETITIONS = 2


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """A command, its output captured; a failure raises with its last lines."""
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done


def build(work: Path, jobs: int) -> Path:
    """llama-cpp-python's source distribution under `work`, its vendored llama.cpp built (llama-bench and the shared
    library its Python bindings load) and its converter fixed (`fix_converter`); returns the distribution's folder."""
    src = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    llama = src / "vendor" / "llama.cpp"
    if not (llama / "build" / "bin" / "llama-bench").exists():
        work.mkdir(parents=True, exist_ok=True)
        if not src.exists():
            run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "--no-binary",
                 ":all:", "--no-deps", "-d", str(work)])  # fmt: skip
            with tarfile.open(work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as archive:
                archive.extractall(work, filter="data")
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]  # fmt: skip
        print("building llama.cpp (about ten minutes on 2 cores) ...", flush=True)
        run(["cmake", "-S", str(llama), "-B", str(llama / "build"), *flags])
        run(["cmake", "--build", str(llama / "build"), "--target", "llama-bench", "llama", "-j", str(jobs)])
    fix_converter(llama)
    # the Python bindings' own dependencies (llama-cpp-python's pyproject), for loading them from the source folder
    run([sys.executable, "-m", "pip", "install", "--quiet", "diskcache>=5.6.1", "jinja2>=2.11.3", "numpy>=1.20"])
    return src


def _patch(file: Path, done: str, edits: list[tuple[str, str, str]]) -> None:
    """Apply `edits` ((anchor, replacement, what the anchor is)) to `file` once: not where `done` is already in it; a
    missing anchor is named (another llama.cpp version)."""
    text = file.read_text()
    if done in text:
        return
    for anchor, replacement, what in edits:
        if anchor not in text:
            raise RuntimeError(f"{file}: {what} was not found (another llama.cpp version?)")
        text = text.replace(anchor, replacement, 1)
    file.write_text(text)


def fix_converter(llama: Path) -> None:
    """The three fixes llama.cpp's converter needs for the embedded models (idempotent)."""
    # transformers' config fills num_experts_per_tok in for every Nemotron-H: MoE only where a block is one, and a
    # dense model's MLP blocks are blocks with a feed-forward
    moe_test = '        has_moe_params = "num_experts_per_tok" in llm_config\n'
    dense = (
        '        has_moe_params = "num_experts_per_tok" in llm_config and "moe" in (  # ssmspec: dense blocks\n'
        '            llm_config.get("layers_block_type") or ["moe"])\n'
    )
    _patch(llama / "conversion" / "nemotron.py", "ssmspec: dense", [
        (moe_test, dense, "Nemotron-H's MoE test"),
        ('    _MLP_LAYER_TYPES = {"moe"}\n', '    _MLP_LAYER_TYPES = {"moe", "mlp"}  # ssmspec\n',
         "Nemotron-H's MLP block types"),
    ])  # fmt: skip
    table_end = "        if res is None:\n            logger.warning"
    gpt2 = (f'        if chkhsh == "{TOKENIZER_HASH}":\n'
            '            res = "gpt-2"  # ssmspec\'s byte-level BPE: the gpt-2 regex\n\n')  # fmt: skip
    _patch(llama / "conversion" / "base.py", TOKENIZER_HASH,
           [(table_end, gpt2 + table_end, "the pre-tokenizer table's end")])  # fmt: skip
    partial = (
        '        _rot = self.hparams.get("attn_rotary_emb")  # ssmspec: permute only the rotated part of a head\n'
        '        if self.undo_permute and _rot and name.endswith(("q_proj.weight", "k_proj.weight")):\n'
        '            _nh = n_head if "q_proj" in name else n_kv_head\n'
        "            _hd = data_torch.shape[0] // _nh\n"
        "            if _rot < _hd:\n"
        "                _w = data_torch.reshape(_nh, _hd, *data_torch.shape[1:]).clone()\n"
        "                _w[:, :_rot] = _w[:, :_rot].reshape(_nh, 2, _rot // 2, *data_torch.shape[1:])"
        ".swapaxes(1, 2).reshape(_nh, _rot, *data_torch.shape[1:])\n"
        "                data_torch = _w.reshape(data_torch.shape)\n"
        "                _rot = -1\n"
        "        if self.undo_permute and _rot != -1:\n"
    )
    # (modify_tensors' permutation: the converter's first `if self.undo_permute:` is another method's)
    q_proj = '            if name.endswith(("q_proj.weight", "q_proj.bias")):\n'
    _patch(llama / "conversion" / "llama.py", "attn_rotary_emb",
           [("        if self.undo_permute:\n" + q_proj, partial + q_proj,
             "LlamaModel.modify_tensors' q/k permutation")])  # fmt: skip


def convert(src: Path, name: str, out: Path) -> Path:
    """The embedded model `name` as an f32 GGUF file (a partial rotary embedding's rotated width in its config)."""
    gguf = out / f"{name}-f32.gguf"
    if gguf.exists():
        return gguf
    folder = Path(models.__file__).parent / name
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / name
        shutil.copytree(folder, copy)
        config = json.loads((copy / "config.json").read_text())
        factor = (config.get("rope_parameters") or {}).get("partial_rotary_factor")
        if factor and factor < 1:
            head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            config["attn_rotary_emb"] = int(head * factor)
        if config.get("model_type") == "nemotron_h" and "moe" not in config["layers_block_type"]:
            dense_nemotron_h(copy, config)
        (copy / "config.json").write_text(json.dumps(config))
        llama = src / "vendor" / "llama.cpp"
        env = {**os.environ, "PYTHONPATH": str(llama / "gguf-py")}
        run([sys.executable, str(llama / "convert_hf_to_gguf.py"), str(copy), "--outtype", "f32", "--outfile",
             str(gguf)], env=env)  # fmt: skip
    return gguf


def dense_nemotron_h(folder: Path, config: dict) -> None:
    """A dense Nemotron-H checkpoint without its MTP layer (which llama.cpp's converter takes for a MoE model's and
    llama.cpp does not draft with) and without a draft head beside it."""
    from safetensors.torch import load_file, save_file

    config.update(num_nextn_predict_layers=0, n_routed_experts=0, num_experts_per_tok=0, n_group=0, topk_group=0)
    weights = folder / "model.safetensors"
    state = {k: v for k, v in load_file(str(weights)).items() if not k.startswith("mtp.")}
    save_file(state, str(weights), metadata={"format": "pt"})
    for extra in folder.glob("draft_head.*"):
        extra.unlink()


def llama_bench(src: Path, gguf: Path, threads: int, tokens: int, repetitions: int = BENCH_REPETITIONS) -> float:
    """llama-bench's tokens/s generating `tokens` tokens (tg): the fastest of `repetitions` (as the other methods'
    fastest round is kept)."""
    bin_dir = src / "vendor" / "llama.cpp" / "build" / "bin"
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    done = run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens),
                "-r", str(repetitions), "-o", "json"], env=env)  # fmt: skip
    result = json.loads(done.stdout)[0]
    return float(max(result.get("samples_ts") or [result["avg_ts"]]))


class LlamaCpp:
    """llama.cpp through its Python bindings (llama-cpp-python's pure-Python package over the built library)."""

    def __init__(self, src: Path, gguf: Path, threads: int) -> None:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(src / "vendor" / "llama.cpp" / "build" / "bin")
        sys.path.insert(0, str(src))
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
                         verbose=False)  # fmt: skip

    def greedy(self, ids: list[int], tokens: int) -> list[int]:
        """`tokens` greedy tokens after the prompt `ids` (token ids, HF's)."""
        out = []
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) == tokens:
                break
        return out


def measure(name: str, args, src: Path | None, out_dir: Path) -> dict:
    """One model's rows: tokens/s of every method over the same prompts, each call alternated with the others."""
    ref, tok = models.load(name)
    ref.eval()
    prompts = held_out_prompts(tok, args.prompts, args.prompt_tokens)
    new = args.max_new_tokens
    with torch.no_grad():
        wants = [ref.generate(p, max_new_tokens=new, do_sample=False) for p in prompts]
    tokens = sum(w.shape[1] - p.shape[1] for w, p in zip(wants, prompts))
    eager = ssmspec.transform(models.load(name)[0].eval())
    plain = ssmspec.SpecConfig(drafter="none")
    methods = {  # (a prompt, the tokens to generate)
        "HF generate": lambda p, n: ref.generate(p, max_new_tokens=n, do_sample=False),
        "ssmspec plain (eager)": lambda p, n: eager.generate(p, max_new_tokens=n, speculation=plain),
        "ssmspec default (eager)": lambda p, n: eager.generate(p, max_new_tokens=n),
    }
    warmup, compiler, compiled_before = None, None, 0
    if args.compiled:
        t0 = time.perf_counter()
        compiled = ssmspec.transform(models.load(name)[0].eval(), compile={"progress": False})
        warmup = time.perf_counter() - t0
        compiler = compiled.__dict__.get("_ssmspec_step_compiler")
        compiled_before = compiler.compilations if compiler is not None else 0
        methods["ssmspec plain (compiled)"] = lambda p, n: compiled.generate(p, max_new_tokens=n, speculation=plain)
        methods["ssmspec default (compiled)"] = lambda p, n: compiled.generate(p, max_new_tokens=n)
    llama, llama_same = None, ""
    if src is not None:
        gguf = convert(src, name, out_dir)
        llama = LlamaCpp(src, gguf, args.threads)
        got = [llama.greedy(p[0].tolist(), w.shape[1] - p.shape[1]) for p, w in zip(prompts, wants)]
        at_ties = 0
        for i, (g, w, p) in enumerate(zip(got, wants, prompts)):
            want = w[0, p.shape[1] :].tolist()
            if g != want:  # another arithmetic may flip a near-tie of HF's (TIE: ssmspec check's float32 rule)
                first = next(j for j in range(len(want)) if j >= len(g) or g[j] != want[j])
                with torch.no_grad():
                    logits = ref(w[:, : p.shape[1] + first]).logits[:, -1]
                if not bool(near_ties(logits, TIE)):
                    raise RuntimeError(f"{name}: llama.cpp's greedy tokens differ from HF's on prompt {i} at token "
                                       f"{first}, where HF's top-2 logits are not a near-tie")  # fmt: skip
                at_ties += 1
        llama_same = f"{len(prompts) - at_ties}/{len(prompts)}" + (f" ({at_ties} at a near-tie)" if at_ties else "")
        methods["llama.cpp (Python bindings)"] = lambda p, n: llama.greedy(p[0].tolist(), n)
    bench = 0.0  # llama-bench's fastest generation rate, run once a round between the other methods' calls
    seconds = dict.fromkeys(methods, 0.0)
    first = dict.fromkeys(methods, 0.0)  # a call of one new token: the prompt's processing and the call's own cost
    identical = dict.fromkeys(methods, 0)
    for p, want in zip(prompts, wants):
        # every method once per round, alternated, and each prompt's fastest round kept (a slower spell of this
        # machine, which moves a rate by 30% for seconds at a time, hits one round, not the method)
        fastest = {m: [float("inf"), float("inf")] for m in methods}
        for r in range(args.rounds):
            for method, fn in methods.items():
                best, out = best_time(lambda fn=fn, p=p: fn(p, new), 1)
                one = best_time(lambda fn=fn, p=p: fn(p, 1), 1)[0]
                fastest[method] = [min(fastest[method][0], best), min(fastest[method][1], one)]
                if isinstance(out, list):
                    out = torch.cat([p, torch.tensor([out])], 1)
                identical[method] += int(torch.equal(out, want)) if r == 0 else 0
            if src is not None:  # llama-bench in the same rounds (see the module's docstring)
                bench = max(bench, llama_bench(src, gguf, args.threads, new))
        for method, (best, one) in fastest.items():
            seconds[method] += best
            first[method] += one
    rows = [{"method": m, "tokens_per_s": tokens / seconds[m],
             "decode_tokens_per_s": (tokens - len(prompts)) / (seconds[m] - first[m]),
             "identical": llama_same if m.startswith("llama.cpp") else f"{identical[m]}/{len(prompts)}"}
        for m in methods]  # fmt: skip
    if src is not None:  # (generation alone: no prompt)
        rows.append({"method": "llama.cpp (llama-bench)", "tokens_per_s": bench, "decode_tokens_per_s": bench,
                     "identical": "checked above"})  # fmt: skip
    hf = rows[0]["tokens_per_s"]
    best_plain = max(r["tokens_per_s"] for r in rows if "plain" in r["method"] or r["method"] == "HF generate")
    for r in rows:
        r["x_hf"] = r["tokens_per_s"] / hf
        r["x_best_ssmspec_plain"] = r["tokens_per_s"] / best_plain
    llama_rate = next((r["tokens_per_s"] for r in rows if r["method"] == "llama.cpp (llama-bench)"), None)
    if llama_rate:  # (decoding rates against llama-bench's, which times generation alone)
        for r in rows:
            r["x_llamacpp"] = r["decode_tokens_per_s"] / llama_rate
    # steps compiled during the timed calls (0: the warm-up compiled every step they took)
    timed_compilations = (compiler.compilations if compiler is not None else 0) - compiled_before
    return {"model": name, "prompts": len(prompts), "tokens": tokens, "warmup_s": warmup,
            "compiled_while_timed": timed_compilations, "rows": rows}  # fmt: skip


def cold_start(name: str) -> dict:
    """`transform(model, compile=True)` in a fresh process with an empty Inductor cache, then again with its cache."""
    code = (f"import time, ssmspec; from ssmspec import models; m = models.load({name!r})[0].eval(); "
            "t = time.perf_counter(); ssmspec.transform(m, compile={'progress': False}); "
            "print(time.perf_counter() - t)")  # fmt: skip
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for label in ("cold_s", "cached_s"):
            out[label] = float(run([sys.executable, "-c", code], env=env).stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mamba2-target", "bamba-hybrid"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="timed calls of each method per prompt (the fastest is kept)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=str(Path.home() / ".cache" / "ssmspec" / "llamacpp"),
                   help="where llama.cpp is built and the GGUF files are kept")  # fmt: skip
    p.add_argument("--skip-llamacpp", action="store_true", help="HF and ssmspec only (no build)")
    p.add_argument(
        "--no-compiled",
        dest="compiled",
        action="store_false",
        help="eager ssmspec only (no compiled model: its warm-up takes minutes on a larger model)",
    )
    p.add_argument("--cold-start", action="store_true", help="also time the compiled warm-up in fresh processes")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work).expanduser()
    src = None if args.skip_llamacpp else build(work, args.threads)
    result = {
        "setup": f"CPU, {args.threads} threads, float32, batch 1, {args.prompts} held-out prompts x "
        f"{args.prompt_tokens} tokens, {args.max_new_tokens} new tokens, greedy; tokens/s over all prompts, each call "
        f"timed {args.rounds} "
        f"times alternating with the other methods, the fastest kept (llama-bench's tg: {BENCH_REPETITIONS} "
        "repetitions once a round, the fastest kept); llama.cpp f32 GGUF from llama-cpp-python "
        f"{LLAMA_CPP_PYTHON}'s vendored source (GGML_NATIVE)",
        **provenance("python benchmarks/llamacpp.py " + " ".join(sys.argv[1:])),
        "models": [],
    }
    for name in args.models:
        row = measure(name, args, src, work)
        if args.cold_start:
            row["cold_start"] = cold_start(name)
        result["models"].append(row)
        warm = f"compiled warm-up {row['warmup_s']:.1f} s" if row["warmup_s"] is not None else "eager only"
        print(f"\n{name} ({warm}{_cold(row)})")
        print(f"{'method':30} {'tok/s':>7} {'decode tok/s':>13} {'x HF':>6} {'decode x llama-bench':>21}  identical")
        for r in row["rows"]:
            lc = f"{r['x_llamacpp']:.2f}" if "x_llamacpp" in r else "-"
            print(
                f"{r['method']:30} {r['tokens_per_s']:7.0f} {r['decode_tokens_per_s']:13.0f} {r['x_hf']:6.2f} "
                f"{lc:>21}  {r['identical']}"
            )
    if args.json:
        write_json(result, args.json)


def _cold(row: dict) -> str:
    cold = row.get("cold_start")
    return f"; fresh process: {cold['cold_s']:.1f} s cold, {cold['cached_s']:.1f} s cached" if cold else ""


if __name__ == "__main__":
    main()
