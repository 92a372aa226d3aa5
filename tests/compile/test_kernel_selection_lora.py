"""`compile --max-loras N --max-lora-rank R`: the LoRA shrink/expand specializations of every
adapted product after fusion (no compilation)."""

from __future__ import annotations

import pytest

from lmfoundry.compile.kernel_selection import select_kernels
from lmfoundry.compile.source import load_checkpoint
from lmfoundry.errors import UserError


def covers(build, kernel):
    return sorted((tuple(sorted(c["shape"].items())), tuple(sorted(s.semantics.items())), tuple(c["used_by"]))
                  for s in build.specs if s.kernel == kernel for c in s.covers)


def test_lora_kernels_cover_every_product_at_the_rank(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", group=32, weights=False))  # hidden 128, 2 x 64 heads, 1 KV
    build = select_kernels(ck, [90, 80], lora=(4, 8))
    assert build.lora == {"max_loras": 4, "max_rank": 8}
    shrink = {(dict(shape)["K"], dict(shape)["S"], used[0]) for shape, _, used in covers(build, "lora_shrink")}
    assert shrink == {(128, 3 * 8, "self_attn.qkv_proj.lora"), (128, 8, "self_attn.o_proj.lora"),
                      (128, 2 * 8, "mlp.gate_up_proj.lora"), (256, 8, "mlp.down_proj.lora")}
    expand = {(dict(shape)["N"], dict(shape)["R"], dict(sem)["PARTS"]) for shape, sem, _ in covers(build, "lora_expand")}
    assert expand == {(256, 8, 3), (128, 8, 1), (512, 8, 2)}  # q/k/v 128+64+64, o and down 128, gate/up 2 x 256
    assert {s.capability for s in build.specs if s.kernel.startswith("lora")} == {90, 80}
    assert all(s.types == {"act": "bf16"} for s in build.specs if s.kernel.startswith("lora"))


def test_no_lora_kernels_unless_asked(make_checkpoint):
    ck = load_checkpoint(make_checkpoint(scheme="w4a16", group=32, weights=False))
    build = select_kernels(ck, [90])
    assert build.lora is None and not [s for s in build.specs if s.kernel.startswith("lora")]
    with pytest.raises(UserError, match="at least 1"):
        select_kernels(ck, [90], lora=(0, 8))


def test_compile_refuses_lora_kernels_where_they_do_not_apply(make_checkpoint, tmp_path, capsys):
    from helpers import assert_one_error, run_cli

    ckpt = str(make_checkpoint(scheme="w4a16", group=32))
    code, _, err = run_cli(["compile", ckpt, "--arch", "cpu", "--max-loras", "2", "-o", str(tmp_path / "e")], capsys)
    assert_one_error(code, err, "--max-loras builds GPU kernels")
    code, _, err = run_cli(["compile", ckpt, "--arch", "hopper", "--tp", "2", "--max-loras", "2",
                            "-o", str(tmp_path / "e")], capsys)
    assert_one_error(code, err, "LoRA kernels with --tp")
    assert not (tmp_path / "e").exists()
