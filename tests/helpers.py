"""Builders shared by tests: tiny random Llama-family checkpoints written as HF folders.

Import in tests as `from helpers import tiny_model_folder` (tests/ is on sys.path through
conftest.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lmfoundry.model.attention_math import AttentionSpec
from lmfoundry.model.config import ModelConfig
from lmfoundry.model.reference import CausalLM

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256,
        "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "tie_word_embeddings": True, "rope_theta": 1000000.0,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", "hidden_act": "silu",
        "use_sliding_window": False,
    },
}
TINY_CONFIGS["qwen3"] = dict(TINY_CONFIGS["llama"], architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                             head_dim=48, rope_theta=1000000.0, tie_word_embeddings=True)
TINY_CONFIGS["mistral"] = dict(TINY_CONFIGS["llama"], architectures=["MistralForCausalLM"], model_type="mistral",
                               sliding_window=None)


def tiny_tokenizer(vocab_size: int = 256):
    """A byte-level-ish word tokenizer with a chat template (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    chars = [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    extra = [f"<x{i}>" for i in range(vocab_size - len(vocab))]
    vocab.update({t: len(vocab) + i for i, t in enumerate(extra)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return fast


def tiny_model_folder(path: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random model of `model_type` as a HF folder (config, safetensors, tokenizer)."""
    cfg = dict(TINY_CONFIGS[model_type], **overrides)
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 2:
                p.normal_(0.0, 0.02 if "embed" in name else 1.0 / p.shape[1] ** 0.5)
            else:
                p.normal_(0.0, 0.02)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tiny_tokenizer(cfg["vocab_size"]).save_pretrained(str(path))
    return path


def write_text(path: Path, n_words: int = 4000, seed: int = 0) -> Path:
    """Deterministic pseudo-English text for calibration in tests."""
    import random

    rng = random.Random(seed)
    words = ["the", "model", "layer", "weight", "scale", "token", "cache", "block", "group", "value",
             "quantize", "attention", "matrix", "error", "data", "of", "and", "to", "in", "is"]
    path.write_text(" ".join(rng.choice(words) for _ in range(n_words)) + "\n")
    return path


def reference_greedy(model, ids: list[int], max_tokens: int, eos: int | None = None) -> list[int]:
    """Greedy continuation by full recomputation with the reference model (no KV cache): what
    every engine path must reproduce token for token. Stops after `eos` when given."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            tok = int(model(torch.tensor([ids]))[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok == eos:
                break
    return out


def tiny_decoder_layer(arch: str = "llama", seed: int = 0, tokens: int = 10):
    """(layer, cos, sin, config): one random decoder layer of a tiny config with the rotary tables
    for `tokens` positions — what a quantizer's hooks see inside the layer-wise pipeline."""
    import torch

    from lmfoundry.model.attention_math import RotaryEmbedding
    from lmfoundry.model.config import ModelConfig
    from lmfoundry.model.reference import DecoderLayer

    torch.manual_seed(seed)
    config = ModelConfig.from_dict(TINY_CONFIGS[arch])
    layer = DecoderLayer(config, 0).eval()
    cos, sin = RotaryEmbedding(config)(torch.arange(tokens).unsqueeze(0), torch.float32)
    return layer, cos, sin, config


def wait_for_url(proc: Any, timeout: float = 120) -> str:
    """The URL a `lmfoundry serve` subprocess prints once it listens (kills it on timeout)."""
    import re
    import time

    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if m := re.search(r"serving on (http://\S+)", line):
            return m.group(1)
    proc.kill()
    raise AssertionError("no URL printed:\n" + "".join(seen))


def start_serve(args: list[str], own_session: bool = False) -> Any:
    """`lmfoundry serve ARGS` as a user runs it: a one-thread subprocess whose output is readable
    line by line (see `wait_for_url`). `own_session`: in a process group of its own, as a service
    manager starts it (so that the test can signal the whole group)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "lmfoundry.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=own_session)


def stop_serve(proc: Any) -> None:
    """Stop a `start_serve` process the way a user does (Ctrl-C); failing the test if it does
    not exit within 30 s."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("serve did not stop on SIGINT") from None


def w4a16_checkpoint() -> Path:
    """RTN W4A16 (group 64: 576 is not a multiple of 128) of the default model, built once."""
    import os
    import subprocess
    import sys

    from lmfoundry.resources import cache_dir

    out = cache_dir() / "test-artifacts" / "smollm2-135m-w4a16-g64-rtn"
    if not (out / "config.json").exists():
        cmd = [sys.executable, "-m", "lmfoundry.cli", "quantize", "smollm2-135m", "--method", "rtn", "--scheme",
               "w4a16", "--group-size", "64", "-o", str(out), "--overwrite", "--quiet"]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    return out


def poison_sampler(monkeypatch: Any, seed: int = 666) -> None:
    """Make the sampler raise for the rows of requests with `seed` (and only those): a fault
    inside one request, past validation, for the failure-isolation tests."""
    from lmfoundry.runtime.engine import sampler as sampler_module

    real = sampler_module.sample_row

    def poisoned(logits: Any, params: Any, generator: Any) -> Any:
        if params.seed == seed:
            raise RuntimeError("poisoned sampler row")
        return real(logits, params, generator)

    monkeypatch.setattr(sampler_module, "sample_row", poisoned)


def assert_engine_serves_like_reference(model, prompts: list[list[int]], max_tokens: int = 12) -> None:
    """The paged, chunked-prefill engine's greedy output equals `reference_greedy` token for token
    (small blocks and an 8-token batch budget, so prefill is chunked and blocks are crossed)."""
    from lmfoundry.runtime.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(model, None, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == reference_greedy(model, p, max_tokens)


def gpu_kernels_benchmark() -> Any:
    """benchmarks/gpu_kernels.py as a module (it is a script, not a package): its GPU-independent
    parts (shapes, byte and FLOP counts, checks, peers) are tested on CPU so a lent GPU's minutes
    are not spent finding a harness bug."""
    return benchmark_script("gpu_kernels")


def benchmark_script(name: str) -> Any:
    """benchmarks/NAME.py loaded as a module (its siblings import as the script imports them)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_transformers_model(model_cls: Any, config: Any, folder: Path, norm_center: float = 1.0,
                            embed_std: float = 0.1) -> Path:
    """A random transformers model saved with save_pretrained (+ the tiny tokenizer), weights with
    real signal: unit-scale linears (transformers' init is std 0.02, which makes every layer a near
    identity that hides attention differences) and norm gains norm_center + N(0, 0.1²) (Gemma stores
    w of 1 + w: norm_center 0)."""
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0.0, embed_std)
            elif p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    model.save_pretrained(str(folder))
    tiny_tokenizer(config.vocab_size).save_pretrained(str(folder))
    return folder


def hf_eager(folder: Path) -> Any:
    """transformers' own float32 model of `folder` with eager attention (the masks as written)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def run_cli(args: list[str], capsys: Any) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of an in-process CLI run."""
    from lmfoundry.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_error(code: int, err: str, *needles: str) -> None:
    """A user mistake's outcome: non-zero exit, one `error:` line naming `needles`, no traceback."""
    assert code != 0, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], err


# ---- an offline lm-eval task (multiple choice, JSONL named by absolute path) ------------------------
QUESTIONS = [
    ("What color is the sky on a clear day?", ["blue", "green", "red"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("Which planet is closest to the sun?", ["Venus", "Mars", "Mercury"], 2),
    ("What do bees make?", ["honey", "milk", "silk"], 0),
    ("What is frozen water called?", ["steam", "ice", "fog", "dew"], 1),
    ("Which animal barks?", ["cat", "cow", "dog"], 2),
    ("What is two plus two?", ["four", "five", "three"], 0),
    ("Where do fish live?", ["trees", "water", "sand"], 1),
    ("What do plants need to grow?", ["noise", "darkness", "light and water"], 2),
    ("Which season is the coldest?", ["winter", "summer", "spring", "autumn"], 0),
    ("What does a thermometer measure?", ["weight", "temperature", "length"], 1),
    ("Which shape has three sides?", ["square", "circle", "triangle"], 2),
]


def write_task(folder: Path) -> str:
    """An offline multiple-choice task: a JSONL file and a YAML that names it by absolute path."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "tiny_mc.yaml").write_text(f"""task: lmf_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data.resolve()))}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return "lmf_tiny_mc"


def engine_outside_the_package(**config: Any) -> Any:
    """An engine factory only the tests' sys.path can import (an engine process must find it)."""
    from toy import toy_engine

    return toy_engine(seed=2, **config)


def copy_checkout(dst: Path) -> Path:
    """A plain copy of this checkout at `dst`: the files a fresh clone has plus uncommitted ones
    (git), else the tree minus build output."""
    import shutil
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    try:
        listing = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo,
                                 capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(repo, dst, ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", "build", "dist", "*.egg-info", "demo-out"))
        return dst
    for rel in filter(None, listing):
        src = repo / rel
        if src.is_file():  # a deleted, not yet committed file is still listed
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def site_entry_owners() -> dict[str, set[str]]:
    """Each site-packages entry (a package folder, a module file, a .libs or .dist-info folder) ->
    the names of the installed distributions whose files it holds."""
    from importlib import metadata

    owners: dict[str, set[str]] = {}
    for dist in metadata.distributions():
        for f in dist.files or []:
            owners.setdefault(f.parts[0], set()).add(dist.metadata["Name"])
    return owners


def linked_venv(root: Path, keep: Any) -> Path:
    """A new venv at root/venv, without pip of its own, that reaches this venv's installed packages
    through a .pth file naming root/deps, a folder of links to the site-packages entries that
    `keep(entry name, names of the distributions whose files it holds)` accepts; .pth files (an
    editable install's finder) are never linked."""
    import subprocess
    import sys
    import sysconfig

    owners = site_entry_owners()
    venv, deps = root / "venv", root / "deps"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    deps.mkdir()
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(site).iterdir():
            if entry.name.endswith(".pth") or (deps / entry.name).exists() or not keep(entry.name, owners.get(entry.name, set())):
                continue
            (deps / entry.name).symlink_to(entry)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    Path(purelib, "project-venv-deps.pth").write_text(f"{deps}\n")
    return venv


def plant_checkout(folder: Path) -> Path:
    """A folder laid out like lmfoundry's source checkout root whose `lmfoundry/` and `kernels/`
    fail on import: a process that imports either from its working directory says so."""
    for name in ("lmfoundry", "kernels"):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('{name} imported from the checkout at ' + __file__)\n")
    (folder / "pyproject.toml").write_text("[project]\nname = 'lmfoundry'\n")
    return folder


def engine_off_the_checkout(**config: Any) -> Any:
    """An engine factory that refuses to build in a process whose sys.path holds a checkout root
    (or the working directory, ''): there the checkout's `kernels/` would shadow Hugging Face's."""
    import sys

    from lmfoundry.child_python import is_checkout_root

    bad = [p for p in sys.path if p == "" or is_checkout_root(p)]
    if bad:
        raise RuntimeError(f"the engine process imports from {bad}")
    return engine_outside_the_package(**config)


def correlated_inputs(n: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Calibration-like inputs [n, cols]: correlated columns with outlier channels."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5
    mags = torch.logspace(-1, 1, cols)[torch.randperm(cols, generator=g)]  # outlier channels
    return (torch.randn(n, cols, generator=g) @ mix + 0.1 * torch.randn(n, cols, generator=g)) * mags



def collectives_rank(backend: str, folder: str, rank: int, world: int, sizes: list[int], queue: Any,
                     exit_early: bool = False, timeout: float = 60.0) -> None:
    """One rank of a collectives test: all-reduce and gather seeded tensors of each size (every
    rank can rebuild every rank's input), and put on `queue` per collective: the largest error
    against the rank-order sum / the inputs, and a digest of the result's bytes (the ranks'
    results must be the same bits). With `exit_early` the rank leaves before the first
    collective (a lost rank); a rank that sees a peer lost (here: no answer in `timeout`) puts
    ("lost", why)."""
    import hashlib
    from pathlib import Path

    from lmfoundry.runtime.engine.collectives import RankLost, open_collectives

    def seeded(r: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return (torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + n)).abs() + 1.0).to(dtype)

    comm = open_collectives(backend, Path(folder), rank, world, timeout=timeout)
    if exit_early:
        return
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    got: list[Any] = []
    try:
        for n in sizes:
            for dtype in (torch.float32, torch.bfloat16):
                inputs = [seeded(r, n, dtype).to(device) for r in range(world)]
                expect = inputs[0].clone()
                for x in inputs[1:]:
                    expect += x
                out = comm.all_reduce(inputs[rank].clone())
                err = float(((out.float() - expect.float()).abs() / expect.float().abs()).max())
                digest = hashlib.sha256(out.cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
                got.append(("reduce", n, str(dtype), err, digest))
                parts = comm.gather(inputs[rank].clone())
                ok = parts is None if rank else all(torch.equal(p, x) for p, x in zip(parts, inputs, strict=True))
                got.append(("gather", n, str(dtype), ok))
    except RankLost as exc:
        got.append(("lost", str(exc)))
    queue.put((rank, got))
    comm.close()


def post_in_background(url: str, body: dict, timeout: float = 60) -> tuple[Any, dict]:
    """POST `body` from a started thread; the response lands in the returned dict under "r"."""
    import threading

    import httpx

    result: dict = {}

    def call() -> None:
        result["r"] = httpx.post(url, json=body, timeout=timeout)

    thread = threading.Thread(target=call)
    thread.start()
    return thread, result


def kernel_model_rank(engine: str, rank: int, tp: int, folder: str, ids: list[int], queue: Any) -> None:
    """One rank of a tensor-parallel bundle as a GPU rank runs it, its `KernelModel` (here on the
    CPU, through the kernels' PyTorch references) joined to the others through shared memory:
    put rank 0's logits of `ids` on `queue`."""
    from pathlib import Path

    from lmfoundry.engine_bundle.engine_manifest import rank_bundle
    from lmfoundry.model.config import ModelConfig
    from lmfoundry.model.tensor_parallel import share_of
    from lmfoundry.runtime.engine.collectives import ShmCollectives
    from lmfoundry.runtime.loader import load_bundle

    torch.set_num_threads(1)
    try:
        from lmfoundry.kernels.dispatch import is_interpreter

        if is_interpreter():  # as tests/conftest.py does in the test process
            from lmfoundry.kernels.interpreter import patch_interpreter

            patch_interpreter()
        comm = ShmCollectives(Path(folder) / "collectives", rank, tp, create=False, timeout=120)
        weights = rank_bundle(engine, rank)
        model, _ = load_bundle(weights, "cpu")
        model.join(share_of(ModelConfig.from_file(weights / "weights").raw, "rank"), comm)
        logits = model(torch.tensor([ids]))
        comm.close()
        queue.put(("ok", logits.numpy() if rank == 0 else None))  # not shared memory: the rank exits
    except Exception as exc:  # noqa: BLE001 - reported to the test
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def assert_greedy_up_to_bf16_ties(model: Any, got: list[list[int]], want: list[Any], ulps: int = 2) -> None:
    """`got` are the greedy tokens of `want` (`model`'s RequestOutputs), except that the sequences
    may part where the two tokens tie at bf16 resolution: the LM head rounds logits to bf16, so
    another execution of the same bf16 model (a compiled step, other kernels, another summation
    order) moves a logit by an ulp or so, and two logits within `ulps` units in the last place of
    their magnitude may then come out in either order. Anywhere else the tokens must agree."""
    for tokens, out in zip(got, want, strict=True):
        ref = out.outputs[0].token_ids
        apart = next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), None)
        if apart is None:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([out.prompt_token_ids + ref[:apart]]))[0, -1]
        mine, theirs = float(logits[tokens[apart]]), float(logits[ref[apart]])
        ulp = 2.0 ** (math.floor(math.log2(max(abs(mine), abs(theirs), 2.0**-100))) - 7)  # bf16: 8-bit significand
        assert abs(mine - theirs) <= ulps * ulp, (
            f"tokens part at {apart} where the reference's logits are {abs(mine - theirs) / ulp:.1f} bf16 ulps apart "
            f"({mine:.4f} vs {theirs:.4f}): {tokens} vs {ref}")


def run_cli_on_a_small_disk(args: list[str], mount: Path, size: str = "64k") -> tuple[int, str, list[str]]:
    """`lmfoundry ARGS` with a tmpfs of `size` mounted at `mount` (an empty folder) in a mount
    namespace of its own, so that writing there really runs out of space; (exit code, stderr,
    what was left in the mount afterwards). Skips the test where namespaces cannot be made."""
    import os
    import subprocess
    import sys

    import pytest

    script = f'mount -t tmpfs -o size={size} tmpfs "{mount}" || exit 97; "$@"; rc=$?; echo "LEFT:$(ls -A "{mount}")"; exit $rc'
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", sys.executable, "-m", "lmfoundry.cli", *args],
                              capture_output=True, text=True, timeout=300, env=env)
    except FileNotFoundError:
        pytest.skip("no unshare(1) to make a small disk")
    if proc.returncode == 97 or "LEFT:" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr.strip()[:200]}")
    left = proc.stdout.split("LEFT:", 1)[1].split()
    return proc.returncode, proc.stderr, left


def check_lora_kernels(shrink: Any, expand: Any, t: int, parts: list[int], rank: int, k: int, dtype: torch.dtype,
                       gen: torch.Generator, device: str = "cpu", slots: int = 3) -> None:
    """One shrink/expand pair (`shrink(x, a, rows, out)`, `expand(s, bt, rows, ends, y)`: the Triton
    ops or the C kernels) over `slots` random adapters of decreasing rank and base rows mixed in,
    against the PyTorch references and float64 within the γ bounds of fp32 accumulation: the
    rank vectors fully written (0 for base rows), base rows of y untouched."""
    from lmfoundry.kernels import lora
    from lmfoundry.kernels.error_bounds import assert_within, assert_written, dot_bound, poisoned

    n = sum(parts)
    a = torch.randn(slots, len(parts) * rank, k, generator=gen) / k**0.5
    bt = torch.randn(slots, rank, n, generator=gen) / rank**0.5
    for slot in range(slots):  # ranks below the max, zero padded as the runtime stacks them
        used = max(1, rank - slot)
        a.view(slots, len(parts), rank, k)[slot, :, used:] = 0
        bt[slot, used:] = 0
    a, bt = a.to(dtype), bt.to(dtype)
    ends = torch.tensor(parts, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows = torch.tensor([(i % (slots + 1)) - 1 for i in range(t)], dtype=torch.int32)
    x = torch.randn(t, k, generator=gen).to(dtype)
    s = poisoned((t, a.shape[1]), torch.float32, device)
    shrink(x.to(device), a.to(device), rows.to(device), s)
    assert_written(s, "lora shrink")
    s = s.cpu()
    live = rows >= 0
    picked = a[rows[live].long()].double()
    exact = torch.zeros(t, a.shape[1], dtype=torch.float64)
    products = torch.zeros_like(exact)
    exact[live] = torch.einsum("tk,tsk->ts", x[live].double(), picked)
    products[live] = torch.einsum("tk,tsk->ts", x[live].double().abs(), picked.abs())
    ref = lora.shrink_reference(x, a, rows)
    assert_within(s, exact, dot_bound(exact, products, k, torch.float32) / 2, "shrink vs float64")
    assert_within(s, ref, dot_bound(ref, products, k, torch.float32), "shrink vs reference")
    assert torch.equal(s[~live], torch.zeros_like(s[~live])), "a base row's rank vector is not zero"

    y0 = torch.randn(t, n, generator=gen).to(dtype)
    y = y0.clone().to(device)
    expand(s.to(device), bt.to(device), rows.to(device), ends.to(device), y)
    y = y.cpu()
    want = y0.clone()
    lora.expand_reference(s, bt, rows, ends, want)
    part = torch.bucketize(torch.arange(n), ends.long(), right=True)  # column -> its part
    gathered = s.double().view(t, len(parts), rank)[:, part, :]  # [T, N, R]
    exact_y, terms = y0.double().clone(), y0.double().abs().clone()
    for i in range(t):
        if rows[i] >= 0:
            b = bt[rows[i].long()].double().t()  # [N, R]
            exact_y[i] += (gathered[i] * b).sum(-1)
            terms[i] += (gathered[i].abs() * b.abs()).sum(-1)
    assert_within(y, want, dot_bound(want, terms, rank + 1, dtype), "expand vs reference")
    assert_within(y, exact_y, dot_bound(exact_y, terms, rank + 1, dtype), "expand vs float64")
    assert torch.equal(y[~live], y0[~live]), "expand touched a base row"


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapter(folder: Path, config: Any, rank: int = 8, alpha: float = 16, seed: int = 0,
                       targets: tuple[str, ...] = LORA_TARGETS, layers: Any = None, dtype: torch.dtype = torch.float32,
                       strength: float = 0.5, **config_fields: Any) -> Path:
    """A random PEFT LoRA folder for a model of `config` (a ModelConfig), as PEFT's save_pretrained
    writes it: adapter_config.json and adapter_model.safetensors with
    `base_model.model.model.layers.{i}.{module}.lora_A/B.weight`. B is random too (PEFT's default
    initializes it to zero, which would be no adapter): each delta is about `strength` times its
    base weight. A target of a fused module ("qkv_proj", "gate_up_proj") gets one A and the
    members' rows of B stacked, as Phi-3 adapters have it."""
    from lmfoundry.model.config import FUSED_LINEARS

    gen = torch.Generator().manual_seed(seed)
    shapes = config.linear_shapes
    full = {n.rsplit(".", 1)[1]: n for n in shapes}
    fused = {g.rsplit(".", 1)[1]: g for g in FUSED_LINEARS}
    tensors = {}
    for i in range(config.num_layers) if layers is None else layers:
        for t in targets:
            if t in fused:
                members = FUSED_LINEARS[fused[t]]
                out, k = sum(shapes[m][0] for m in members), shapes[members[0]][1]
                local = fused[t]
            else:
                (out, k), local = shapes[full[t]], full[t]
            scale = (alpha / rank ** 0.5) if config_fields.get("use_rslora") else alpha / rank
            a = torch.randn(rank, k, generator=gen) / k ** 0.5
            b = torch.randn(out, rank, generator=gen) * (strength / scale / rank ** 0.5)
            prefix = f"base_model.model.model.layers.{i}.{local}"
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
           "use_dora": False, "use_rslora": False, "modules_to_save": None, "fan_in_fan_out": False,
           "base_model_name_or_path": None, "rank_pattern": {}, "alpha_pattern": {}, "lora_dropout": 0.0,
           "task_type": "CAUSAL_LM", "inference_mode": True}
    cfg.update(config_fields)
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def merge_lora(model: Any, folder: Path) -> Any:
    """A float32 copy of the reference `model` with the PEFT adapter in `folder` merged into its
    weights (W + alpha / r B A, read from the files directly): what serving the adapter must
    compute, by the simplest route."""
    import copy
    import re

    from safetensors.torch import load_file

    from lmfoundry.model.config import FUSED_LINEARS

    cfg = json.loads((folder / "adapter_config.json").read_text())
    merged = copy.deepcopy(model).float()
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    with torch.no_grad():
        for name in tensors:
            if not name.endswith("lora_A.weight"):
                continue
            module = re.sub(r"^base_model\.model\.", "", name.removesuffix(".lora_A.weight"))
            a, b = tensors[name].double(), tensors[name.replace("lora_A", "lora_B")].double()
            r = a.shape[0]
            scale = cfg["lora_alpha"] / (r ** 0.5 if cfg.get("use_rslora") else r)
            delta = scale * b @ a
            prefix, local = ".".join(module.split(".")[:3]), module.split(".", 3)[3]
            members = FUSED_LINEARS.get(local, (local,))
            row = 0
            for m in members:
                lin = merged.get_submodule(f"{prefix}.{m}")
                n = lin.weight.shape[0]
                lin.weight += delta[row : row + n].to(lin.weight.dtype)
                row += n
    return merged


def assert_promtool_accepts(url: str, series: str) -> None:
    """Prometheus's own linter (`promtool check metrics`, Debian's prometheus package; .ci/run
    installs it) on a live /metrics, which must export `series`. vLLM's series are left out: their
    names carry ':' by vLLM's design, which promtool flags for every vLLM server too; every other
    series must pass. Skips where promtool is not installed."""
    import shutil
    import subprocess

    import httpx
    import pytest

    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    text = httpx.get(f"{url}/metrics").text
    ours = "\n".join(line for line in text.splitlines() if "vllm:" not in line) + "\n"
    assert series in ours
    result = subprocess.run(["promtool", "check", "metrics"], input=ours, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def plain_lora(model: Any, folder: Path) -> Any:
    """`model` with the PEFT adapter in `folder` added unmerged by plain PyTorch, a forward hook
    on each adapted linear adding scale * (x A^T) B^T in float32: the simplest independent
    statement of an adapter on a base whose weights cannot take a merge (W8A8, FP8)."""
    import re

    from safetensors.torch import load_file

    cfg = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    for name in tensors:
        if not name.endswith("lora_A.weight"):
            continue
        a, b = tensors[name].float(), tensors[name.replace("lora_A", "lora_B")].float()
        scale = cfg["lora_alpha"] / (a.shape[0] ** 0.5 if cfg.get("use_rslora") else a.shape[0])
        module = model.get_submodule(re.sub(r"^base_model\.model\.", "", name.removesuffix(".lora_A.weight")))

        def add(mod: Any, args: Any, out: Any, a: Any = a, b: Any = b, scale: float = scale) -> Any:
            return (out.float() + scale * (args[0].float() @ a.t()) @ b.t()).to(out.dtype)

        module.register_forward_hook(add)
    return model


GEMMA_WINDOW = 8  # tiny Gemmas' sliding window: shorter than the tests' sequences
GEMMA_COMMON = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW,
              max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=3)


def tiny_gemma_folder(folder: Path, model_type: str, **extra: object) -> Path:
    """A random transformers Gemma saved with save_pretrained (+ a tokenizer). Weights get real
    signal: unit-scale linears (transformers' init is std 0.02) and norm gains 1 + N(0, 0.1²)."""
    if model_type == "gemma2":
        from transformers import Gemma2Config as Config
        from transformers import Gemma2ForCausalLM as Model

        cfg = Config(**GEMMA_COMMON, **extra, attn_logit_softcapping=4.0, final_logit_softcapping=10.0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        from transformers import Gemma3ForCausalLM as Model
        from transformers import Gemma3TextConfig as Config

        cfg = Config(**GEMMA_COMMON, **extra, final_logit_softcapping=10.0,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return save_transformers_model(Model, cfg, folder, norm_center=0.0)


def tiny_moe_folder(arch: str, folder: Path) -> Path:
    """A random Mixtral or Qwen3-MoE saved with transformers' save_pretrained (+ the tiny tokenizer)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                  tie_word_embeddings=False, num_experts_per_tok=2)
    if arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_local_experts=4, **common))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                                   head_dim=16, norm_topk_prob=True, **common))
    torch.manual_seed(0)
    with torch.no_grad():  # transformers' init is tiny (std 0.02): give every layer real signal
        for name, p in model.named_parameters():
            if "embed" in name:
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.eval().save_pretrained(str(folder))
    tiny_tokenizer(256).save_pretrained(str(folder))
    return folder


class OwnTokens:
    """Attention of a whole prompt over its own tokens (no cache), honouring each layer's
    `AttentionSpec` the plain way: scaled scores, soft-cap, causal and window mask, float32."""

    supports_attention_spec = True

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               spec: AttentionSpec | None = None) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
        scores = qf @ kf.transpose(1, 2) * (spec.scale if spec is not None else q.shape[-1] ** -0.5)
        if spec is not None and spec.softcap:
            scores = spec.softcap * torch.tanh(scores / spec.softcap)
        pos = torch.arange(q.shape[0])
        allowed = spec.allowed(pos, pos) if spec is not None else pos[None, :] <= pos[:, None]
        out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vf
        return out.transpose(0, 1).to(q.dtype)


def copy_with_one_weight_changed(src: Path, dst: Path) -> Path:
    """`cp -p` of model folder `src` with one weight changed in place: the final norm negated
    (every greedy token changes), the file's name, size and modification time kept as they were,
    which is all a cache keyed by file metadata would see."""
    import os
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(src, dst, copy_function=shutil.copy2)
    weights = dst / "model.safetensors"
    before = weights.stat()
    state = load_file(str(weights))
    state["model.norm.weight"] = -state["model.norm.weight"]
    save_file(state, str(weights), metadata={"format": "pt"})
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size
    return dst
