"""cp::merge_: the in-place merge op (CPU fallback here) and its Triton kernel.

The kernel's numerics are checked on CPU tensors through Triton's interpreter,
in a subprocess started with TRITON_INTERPRET=1 so that the setting never
reaches this process or other tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cp_compile  # noqa: F401  (registers torch.ops.cp)
from cp_compile.kernels.merge import merge_partial

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
NEG_INF = float("-inf")
_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET")


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# ----------------------------------------------------------------------------
# The op on CPU: falls back to the eager torch merge.
# ----------------------------------------------------------------------------


def sample(b=2, h=3, s=12, d=8, row_start=0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    acc_out, acc_lse = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, generator=g)
    out = torch.randn(b, h, s - row_start, d, generator=g).to(dtype)
    lse = torch.randn(b, h, s - row_start, generator=g)
    if row_start < s:
        acc_lse[:, :, row_start], acc_out[:, :, row_start] = NEG_INF, 0.0
    if s - row_start > 1:
        lse[:, :, 0], out[:, :, 0] = NEG_INF, 0.0
    return acc_out, acc_lse, out, lse


@pytest.mark.parametrize("row_start", [0, 5, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_op_matches_merge_partial(row_start, dtype):
    acc_out, acc_lse, out, lse = sample(row_start=row_start, dtype=dtype)
    want_out, want_lse = acc_out.clone(), acc_lse.clone()
    if row_start < 12:
        new = merge_partial(want_out[:, :, row_start:], want_lse[:, :, row_start:], out, lse)
        want_out[:, :, row_start:], want_lse[:, :, row_start:] = new
    torch.ops.cp.merge_(acc_out, acc_lse, out, lse, row_start)
    # in place (mul_, addcmul_) rounds the out update differently in the last bit
    torch.testing.assert_close(acc_out, want_out, rtol=2e-7, atol=1e-7)
    assert torch.equal(acc_lse, want_lse)
    assert not acc_out.isnan().any() and not acc_lse.isnan().any()
    if row_start < 12:  # -inf on both sides: stays out = 0, lse = -inf
        assert torch.isneginf(acc_lse[:, :, row_start]).all() and (acc_out[:, :, row_start] == 0).all()


def test_cpu_op_opcheck():
    for args in (sample(), sample(row_start=4, dtype=torch.bfloat16), sample(s=6, row_start=6)):
        torch.library.opcheck(torch.ops.cp.merge_.default, args[:4] + (args[1].shape[2] - args[2].shape[2],))


def test_accumulate_adds_in_place_and_passes_opcheck():
    acc, x = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    want = acc + x
    torch.ops.cp.accumulate_(acc, x)
    assert torch.equal(acc, want)
    torch.library.opcheck(torch.ops.cp.accumulate_.default, (torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)))


def test_op_compiles_fullgraph():
    def step(acc_out, acc_lse, out, lse):
        acc_out = acc_out * 1.0  # a graph input must not be mutated behind aot's back
        acc_lse = acc_lse + 0.0
        torch.ops.cp.merge_(acc_out, acc_lse, out, lse, 3)
        return acc_out, acc_lse

    args = sample(row_start=3)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(*args), step(*args)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda a: (a[0][0], *a[1:], 0), "acc_out must be"),
        (lambda a: (*a[:3], a[3][:, :, :-1], 0), "must cover rows"),
        (lambda a: (*a, 13), "row_start=13 outside"),
        (lambda a: (a[0].half(), a[1].half(), a[2], a[3], 0), "fp32"),
    ],
)
def test_bad_arguments_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.cp.merge_(*bad(sample()))


def test_importing_cp_compile_needs_no_triton():
    # A None entry in sys.modules is how Python spells "not installed" to both `import`
    # (ModuleNotFoundError) and importlib.util.find_spec (None), which torch 2.14 itself
    # calls on import to probe for triton.
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch, cp_compile\n"
        "from cp_compile.kernels.triton_merge import triton_available\n"
        "assert not triton_available()\n"
        "a, l = torch.zeros(1, 1, 4, 2), torch.full((1, 1, 4), float('-inf'))\n"
        "torch.ops.cp.merge_(a, l, torch.ones(1, 1, 2, 2), torch.zeros(1, 1, 2), 2)\n"
        "assert sys.modules['triton'] is None\n"
        "print(a[0, 0, :, 0].tolist(), l[0, 0].tolist())\n"
    )
    env = _env()
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[0.0, 0.0, 1.0, 1.0] [-inf, -inf, 0.0, 0.0]"


# ----------------------------------------------------------------------------
# The Triton kernel, interpreted on CPU tensors.
# ----------------------------------------------------------------------------

from triton_interp_cases import CASES  # noqa: E402  (no torch or triton work at import)


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]'); kernel not tested")
    res = subprocess.run(
        [sys.executable, str(TESTS / "triton_interp_cases.py")],
        env=_env(TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_merge_partial(interpreted, case):
    r = interpreted[case]
    assert not r["nan"]
    assert r["same_neginf"]
    assert r["head_untouched"]
    assert r["unseen_rows_zero"]
    assert r["dtypes"] == ["torch.float32", "torch.float32"]
    assert r["out_err"] <= 2e-6, r
    assert r["lse_err"] <= 2e-6, r


def test_interpreter_setting_does_not_leak(interpreted):
    assert os.environ.get("TRITON_INTERPRET") == _INTERPRET_AT_IMPORT
