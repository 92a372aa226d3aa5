"""Loading an engine: integrity, device matching, fallbacks, and the cubin launch packing."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import pytest
import torch

from lmfoundry.engine_bundle.engine_manifest import EngineIntegrityError
from lmfoundry.kernels import activation, registry, tiled_layout, w4a16, w4a16_tiled
from lmfoundry.kernels.dispatch import is_interpreter
from lmfoundry.kernels.error_bounds import U32, assert_within, exact_weight_bound, unit_roundoff
from lmfoundry.kernels.interpreter import patch_interpreter
from lmfoundry.runtime import cuda_driver, kernel_set
from lmfoundry.runtime.kernel_set import DeviceInfo, load_engine

# These run the JIT fallback on host tensors standing in for device memory (fake driver).
interpreter_only = pytest.mark.skipif(not is_interpreter(), reason="JIT fallback on CPU tensors needs the interpreter")

N_QKV, K = (2 + 2 * 1) * 64, 128  # the fused qkv GEMM of the tiny model


def tiny_linear(gen, n=N_QKV, k=K):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    zp = pack_to_int32(torch.randint(-8, 8, (n, k // 32), generator=gen, dtype=torch.int8), 4, packed_dim=0)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.001).bfloat16()
    return w4a16.PackedLinear(pack_to_int32(q, 4), scale, 4, 32, k, zp)


def tiny_tiled(gen, n=N_QKV, k=K):
    """The tiled layout compile writes for `tiny_linear` (what the bundle's W4A16 kernel reads)."""
    return tiled_layout.repack_tiled(tiny_linear(gen, n, k))


def test_manifest_lists_every_kernel_with_its_hash(hopper_engine):
    m = json.loads((hopper_engine / "engine.json").read_text())
    assert m["toolchain"]["triton"] == "3.7.1" and m["archs"] == {"hopper": {"capability": 90, "sm": "sm_90a"}}
    names = {k["kernel"] for k in m["kernels"]}
    assert names == {"w4a16_tiled", "rmsnorm_quant", "silu_mul", "rotary", "store_kv", "paged_prefill",
                     "paged_decode_split", "paged_decode_reduce"}
    for k in m["kernels"]:
        for ext, rel in k["files"].items():
            assert hashlib.sha256((hopper_engine / rel).read_bytes()).hexdigest() == k["sha256"][ext]
        meta = json.loads((hopper_engine / k["files"]["json"]).read_text())
        assert meta["scratch_params"] == 2  # Triton 3.7 appends global and profile scratch pointers
        assert [p["name"] for p in meta["params"]] == [p.name for p in registry.kernel(k["kernel"]).params]
        if k["kernel"] in ("w4a16_tiled", "paged_prefill"):
            assert "HGMMA" in k["sass"]["mma"], k
        assert k["sass"]["registers"] > 0 and k["sass"]["local_bytes"] == 0, k  # no register spills
        if k["kernel"] == "paged_decode_split":  # the GQA group (2 heads, padded to 16 rows): mma.sync
            assert "HMMA" in k["sass"]["mma"] and k["sass"]["expected_any_of"] == ["HMMA"], k
    assert [f["name"] for f in m["fusions"] if f["applied"]] == ["self_attn.qkv_proj", "mlp.gate_up_proj"]
    assert not (hopper_engine / "weights" / "model.safetensors").is_symlink()  # deployable: repacked
    assert m["weights"]["mode"] == "repack" and m["weights"]["fused_tensors"]


def test_cpu_runs_the_reference(hopper_engine):
    gen = torch.Generator().manual_seed(0)
    ks = load_engine(hopper_engine, "cpu", interpret=False)
    assert ks.mode == "reference"
    w = tiny_linear(gen)
    x = torch.randn(3, K, generator=gen).bfloat16()
    out = ks.w4a16_linear(x, w)
    assert torch.equal(out, w4a16.reference(x, w.weight_packed, w.weight_scale, w.weight_zero_point, None, None, 4, 32))
    assert torch.equal(ks.w4a16_tiled_linear(x, tiled_layout.repack_tiled(w)), out)  # same definition, other layout
    assert ks.stats == {"reference": 2}


def test_pretending_sm80_falls_back_to_jit_with_one_log_line(hopper_engine, caplog):
    with caplog.at_level(logging.WARNING, logger="lmfoundry.engine"):
        ks = load_engine(hopper_engine, "cuda", device_info=DeviceInfo(80, 12080, "pretend A100"))
    assert ks.mode == "jit"
    lines = [r.getMessage() for r in caplog.records if r.name == "lmfoundry.engine"]
    assert len(lines) == 1
    assert "sm_90a" in lines[0] and "sm_80" in lines[0] and "falling back to Triton JIT" in lines[0]
    # The fallback works (through the interpreter on CPU, or JIT on a real GPU), with sm_80 tiles.
    x = torch.randn(5, 2 * 96, generator=torch.Generator().manual_seed(1)).half()
    out = ks.silu_mul(x.to("cpu" if is_interpreter() else "cuda")).cpu()
    ref = activation.reference(x)
    assert_within(out, ref, 2 * unit_roundoff(torch.float16) * ref.double().abs() + 16 * U32 * ref.double().abs() + 1e-7,
                  "jit fallback")
    assert ks.stats == {"jit": 1}


def test_old_driver_falls_back(hopper_engine, caplog):
    with caplog.at_level(logging.WARNING, logger="lmfoundry.engine"):
        ks = load_engine(hopper_engine, "cuda", device_info=DeviceInfo(90, 12020, "H100"))
    assert ks.mode == "jit" and "driver supports CUDA 12.2" in ks.reason


def test_tampered_cubin_is_refused(hopper_engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(hopper_engine, copy, symlinks=True)
    cubin = next((copy / "kernels" / "sm_90a").glob("*.cubin"))
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x01
    cubin.write_bytes(bytes(data))
    for device, info in (("cpu", None), ("cuda", DeviceInfo(90, 12080))):
        with pytest.raises(EngineIntegrityError, match="sha256"):
            load_engine(copy, device, device_info=info)


def test_missing_bundle_and_missing_gpu(tmp_path, hopper_engine):
    from lmfoundry.errors import UserError

    with pytest.raises(UserError, match="no engine.json"):
        load_engine(tmp_path, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            load_engine(hopper_engine, "cuda")


class FakeDriver:
    """Records what would be handed to libcuda."""

    def __init__(self):
        self.loads, self.launches = [], []

    def ensure_context(self, device):
        pass

    def load_function(self, image, entry, shared):
        self.loads.append((image, entry, shared))
        return 1, 0xF00D

    def launch(self, function, grid, threads, shared, stream, args):
        self.launches.append({"function": function, "grid": list(grid), "threads": threads, "shared": shared,
                              "stream": stream, "args": list(args)})


@pytest.fixture
def cubin_set(hopper_engine, monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda_driver, "driver", lambda: fake)
    monkeypatch.setattr(kernel_set, "current_stream", lambda device: 0x5EED)
    # CPU tensors stand in for device memory here: nothing is dereferenced by the fake driver.
    monkeypatch.setattr(kernel_set.ShippedKernel, "check_device", lambda self, call: None)
    ks = load_engine(hopper_engine, "cuda:0", device_info=DeviceInfo(90, 12080, "H100"))
    assert ks.mode == "cubin"
    return ks, fake


def test_cubin_launch_uses_the_shipped_metadata(cubin_set, hopper_engine):
    ks, fake = cubin_set
    gen = torch.Generator().manual_seed(2)
    w = tiny_tiled(gen)
    x = torch.randn(37, K, generator=gen).bfloat16()
    out = torch.empty(37, N_QKV, dtype=torch.bfloat16)
    ks.w4a16_tiled_linear(x, w, out=out)
    assert ks.stats == {"cubin": 1}
    (image, entry, shared), = fake.loads
    launch, = fake.launches
    kernel = ks.launcher.find(w4a16_tiled.make_tiled_call(x, w, out))
    meta = kernel.meta
    assert image == (hopper_engine / kernel.entry["files"]["cubin"]).read_bytes()
    assert entry == meta["entry"] == "w4a16_tiled_kernel" and shared == meta["shared"] == launch["shared"]
    bm, bn, split = kernel.config["BLOCK_M"], kernel.config["BLOCK_N"], kernel.config["SPLIT_K"]
    assert launch["grid"] == [-(-37 // bm), -(-N_QKV // bn), split]
    assert launch["threads"] == 32 * meta["num_warps"] and launch["stream"] == 0x5EED
    args = launch["args"]
    assert len(args) == len(meta["params"]) + 2 and args[-2:] == [("ptr", 0), ("ptr", 0)]
    assert args[0] == ("ptr", x.data_ptr()) and args[1] == ("ptr", w.qweight.data_ptr())
    assert args[5] == ("ptr", out.data_ptr())
    assert args[8:11] == [("i32", 37), ("i32", N_QKV), ("i32", K)]
    # Decode-sized calls take the 16-token bucket: one program per BLOCK_N-row weight tile (and split).
    ks.w4a16_tiled_linear(x[:2], w, out=out[:2])
    small = ks.launcher.find(w4a16_tiled.make_tiled_call(x[:2], w, out[:2]))
    assert small is not kernel and small.config["BLOCK_M"] == 16
    assert fake.launches[-1]["grid"] == [1, -(-N_QKV // small.config["BLOCK_N"]), small.config["SPLIT_K"]]


@interpreter_only
def test_uncovered_or_misaligned_calls_fall_back_to_jit(cubin_set, caplog):
    patch_interpreter()  # the JIT fallback runs bf16 through the interpreter here
    ks, fake = cubin_set
    gen = torch.Generator().manual_seed(3)
    w = tiny_tiled(gen, n=64)  # no layer has N=64: not covered by any shipped kernel
    x = torch.randn(6, K, generator=gen).bfloat16()
    with caplog.at_level(logging.WARNING, logger="lmfoundry.engine"):
        out = ks.w4a16_tiled_linear(x, w)
        ks.w4a16_tiled_linear(x, w)
    assert not fake.launches and ks.stats == {"jit": 2}
    assert sum("no shipped kernel covers" in r.getMessage() for r in caplog.records) == 1  # said once
    ref = w4a16_tiled.tiled_reference(x, w)
    exact, offset, weight_u = w4a16_tiled.tiled_error_terms(w, torch.bfloat16)
    assert_within(out, ref, exact_weight_bound(ref, x, exact, offset, torch.bfloat16, weight_u), "fallback")
    # A covered shape whose activation pointer is not 16-byte aligned breaks a build assumption.
    w = tiny_tiled(gen)
    buf = torch.randn(6 * K + 1, generator=gen).bfloat16()
    x = buf[1:].view(6, K)
    with caplog.at_level(logging.WARNING, logger="lmfoundry.engine"):
        ks.w4a16_tiled_linear(x, w)
    assert not fake.launches and "x_ptr=0x" in caplog.records[-1].getMessage()


@interpreter_only
def test_driver_refusal_falls_back(cubin_set, monkeypatch, caplog):
    """A cubin the driver will not load (e.g. more shared memory than this GPU has) is skipped."""
    patch_interpreter()
    ks, fake = cubin_set

    def refuse(image, entry, shared):
        raise cuda_driver.CudaError("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) failed: CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(fake, "load_function", refuse)
    x = torch.randn(1, 2 * 256, generator=torch.Generator().manual_seed(4)).bfloat16()  # silu_mul, I = 256
    with caplog.at_level(logging.WARNING, logger="lmfoundry.engine"):
        out = ks.silu_mul(x)
    assert ks.stats == {"jit": 1} and "driver refused" in caplog.records[-1].getMessage()
    ref = activation.reference(x)
    assert_within(out, ref, 2 * unit_roundoff(torch.bfloat16) * ref.double().abs() + 16 * U32 * ref.double().abs() + 1e-30,
                  "fallback silu")


def test_host_tensors_are_rejected_on_the_gpu_path(hopper_engine, monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda_driver, "driver", lambda: fake)
    ks = load_engine(hopper_engine, "cuda:0", device_info=DeviceInfo(90, 12080, "H100"))
    with pytest.raises(ValueError, match="engine runs on cuda:0"):
        ks.silu_mul(torch.randn(2, 512).bfloat16())
    assert not fake.launches


def test_arch_matching_rules():
    manifest = {"archs": {"ampere": {"capability": 80, "sm": "sm_80"}, "hopper": {"capability": 90, "sm": "sm_90a"}},
                "toolchain": {"cuda": "12.8", "ptxas": "12.8.93"}}
    assert kernel_set.match_arch(manifest, DeviceInfo(90, 12080))[0] == 90
    assert kernel_set.match_arch(manifest, DeviceInfo(86, 12080))[0] == 80  # sm_80 cubins run on sm_86
    assert kernel_set.match_arch(manifest, DeviceInfo(89, 13000))[0] == 80
    assert kernel_set.match_arch(manifest, DeviceInfo(100, 13000))[0] is None  # sm_90a is arch-specific
    hopper_only = {**manifest, "archs": {"hopper": manifest["archs"]["hopper"]}}
    cap, reason = kernel_set.match_arch(hopper_only, DeviceInfo(80, 12080, "A100"))
    assert cap is None and "sm_80 (A100)" in reason
