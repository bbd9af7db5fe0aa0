"""matmul_ws (ops/products/gluon.py): linear's Gluon product with 128 x 192 tiles on Hopper.

The interpreter has no Gluon: on the CPU the kernel is compiled for sm_90 in every operand layout
(a fresh process, interpreter off) and the tuning candidates are checked; on the H200 its numbers
are checked against float64 and a layer trained through it against torch autograd."""

import pytest
import torch

import teeny
from helpers import compile_for_sm90, run_launches
from teeny import Graph, LoweringMode, lower
from teeny.checks.registry import tolerance
from teeny.core import tuning
from teeny.core.kernel import record_launches
from teeny.fusions.transposed_weights import TransposedWeightLinearOp
from teeny.ops.products import kernels as products_kernels
from teeny.ops.products import launches as products_launches
from teeny.ops.products import tuning as products_tuning
from teeny.ops.products.gluon import matmul_ws
from teeny.ops.products.ops import LinearOp

on_gpu = teeny.DEVICE.type == "cuda"

gpu_only = pytest.mark.skipif(not on_gpu, reason="Gluon runs on the GPU only (the interpreter has none)")


def _products(rows: int, fin: int, fout: int) -> dict:
    """linear's three products (X K-major or M-major, Y K-major or N-major) and the fourth layout,
    a matmul of X^T stored by Y^T stored: X M-major, Y K-major."""
    products = dict(LinearOp.products([(rows, fin), (fout, fin)]))
    products["xt_by_yt"] = products_launches.Product(rows, fout, fin, (1, rows), (1, fin), (fout, 1), [], [])
    return products


def _operands(name: str, rows: int, fin: int, fout: int, gen) -> tuple:
    """float64 (A as it lies, B as it lies, expected Z, bias or None) of one of ``_products``."""
    x, w, dy = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((rows, fin), (fout, fin), (rows, fout)))
    bias = torch.randn(fout, generator=gen, dtype=torch.float64)
    return {
        "forward": (x, w, x @ w.T + bias, bias),
        "grad_input": (dy, w, dy @ w, None),
        "grad_weight": (dy, x, dy.T @ x, None),
        "xt_by_yt": (x.T.contiguous(), w, x @ w.T, None),  # X stored (K, M), Y stored (N, K)
    }[name]


# ------------------------------------------------------------------------------------ CPU


@pytest.mark.slow
def test_kernel_compiles_for_the_h200_in_every_layout():
    """Every operand layout (linear's forward, dX and dW, and X^T by Y^T), with and without the
    bias, bf16 and fp16, compiles for sm_90 as an ahead-of-time bundle would (Triton's arguments
    specialised: host TMA descriptors) into a warp-specialised kernel: 16 wgmma (two
    warpgroups, 4 K16 steps of a 64-wide K step, 2 x 64 rows each), TMA loads and stores,
    registers moved between the partitions, under 227 KiB of shared memory, waiting for the
    kernel before it (programmatic dependent launch) before the partitions start."""
    cases = []
    for dtype in ("bfloat16", "float16"):
        for name, p in _products(328, 136, 200).items():
            tiles = -(-p.M // 128) * -(-p.N // 192)
            cases.append(dict(name=f"{dtype} {name}", dtype=dtype, M=p.M, N=p.N, K=p.K, x=list(p.x), y=list(p.y),
                              bias=name == "forward", tiles=tiles))  # fmt: skip
    # dX adding the gradient waiting (bf16), a float32 dW of fp16 operands (aligned widths)
    products = _products(328, 136, 200)
    for dtype, name, extra in (
        ("bfloat16", "grad_input", dict(addend=True)),
        ("float16", "grad_weight", dict(out="float32")),
    ):
        p = products[name]
        cases.append(dict(name=f"{dtype} {name} {extra}", dtype=dtype, M=p.M, N=p.N, K=p.K, x=list(p.x), y=list(p.y),
                          bias=False, tiles=-(-p.M // 128) * -(-p.N // 192), **extra))  # fmt: skip
    rows = compile_for_sm90("gluon_compile", cases, timeout=900)
    failed = [r for r in rows if not r["ok"]]
    assert not failed, "\n".join(f"{r['case']}: {r['error']}" for r in failed)
    assert len(rows) == 10
    for r, case in zip(rows, cases):
        # three loads a step (a 128-element-wide MN-major box goes as two 128-byte swizzled halves)
        assert r["wgmma"] == 16 and r["tma_loads"] >= 3, r
        assert r["shared"] <= 227 * 1024 and len(r["setmaxnreg"]) >= 2, r
        assert r["waits"] == 1, r
        assert r["grid"] == [case["tiles"]], r  # fewer tiles than multiprocessors: a program each
        if case.get("out") == "float32":  # stored from the registers, the operand stages alone in shared memory
            assert r["tma_stores"] == 0 and r["global_stores"] > 0 and r["shared"] < 170 * 1024, r
        else:
            assert r["tma_stores"] >= 2 and r["global_stores"] == 0, r
    plain, added = rows[1], rows[8]  # bf16 dX, without and with the addend: its two boxes loaded by TMA into
    # the staging buffers, which take no more shared memory than the addend's two barriers
    assert added["tma_loads"] == plain["tma_loads"] + 2 and 0 < added["shared"] - plain["shared"] <= 64, (plain, added)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_every_candidate_of_a_backward_product_launches_kernels_the_pair_declares(dtype, monkeypatch):
    """Whatever configuration tuning picks for linear's backward products (matmul_ws, matmul_tma
    with its copies and segment sums), its launches use only kernels that linear's forward
    kernel declares as its backward: a backward's dry run refuses any other (the patched GPT-2
    under torch.compile met matmul_ws there: docs/archive/bench-journal.md, version 20)."""
    monkeypatch.setattr(products_kernels, "INTERPRETER", False)  # tl.dot precisions as on the GPU
    monkeypatch.setattr(products_tuning, "INTERPRETER", False)  # and configurations
    monkeypatch.setattr(tuning, "has_tma", lambda: True)
    monkeypatch.setattr(tuning, "multiprocessors", lambda: 132)
    declared = set(LinearOp.kernel.backward) | {LinearOp.kernel}
    products = {
        **LinearOp.products([(4096, 768), (768, 768)]),
        "conv1d grad_weight": TransposedWeightLinearOp.products([(4096, 768), (768, 768)])["grad_weight"],
    }
    kinds = set()
    for name, p in products.items():
        row_sums = "grad_weight" in name
        for config in products_tuning.candidates(
            p, dtype=dtype, precision=products_kernels.dot_precision(dtype, False), has_bias=True, row_sums=row_sums
        ):
            x, y = torch.empty(p.M * p.K * 2, dtype=dtype), torch.empty(p.K * p.N * 2, dtype=dtype)
            z, sums = torch.empty(p.M * p.N, dtype=dtype), torch.empty(p.M, dtype=dtype) if row_sums else None
            scratch = lambda shape, d: torch.empty(shape, dtype=d)  # noqa: E731
            launches = products_launches.product_launches(
                p, config, x=x, y=y, z=z, bias=None, dtype=dtype, precision="tf32", scratch=scratch, row_sums=sums
            )
            kinds.add(config["kernel"])
            undeclared = {launch.kernel.name for launch in launches} - {k.name for k in declared}
            assert not undeclared, (name, config, undeclared)
    assert kinds == ({"ws", "tma"} if dtype == torch.bfloat16 else {"tma"})  # (big aligned products: no strided)


def test_candidates_offer_matmul_ws_where_it_applies(monkeypatch):
    """Half-precision, 16-byte aligned 2-D products without an activation epilogue get matmul_ws
    as a tuning candidate (a dW with the bias gradient: summed apart); float32, a transposed Z
    (Conv1D's dW), an activation epilogue and unaligned rows do not. Its launch refuses what it
    cannot compute with a clear error."""
    monkeypatch.setattr(products_kernels, "INTERPRETER", False)  # tl.dot precisions as on the GPU
    monkeypatch.setattr(products_tuning, "INTERPRETER", False)  # and configurations
    monkeypatch.setattr(tuning, "has_tma", lambda: True)
    monkeypatch.setattr(tuning, "multiprocessors", lambda: 132)
    products = LinearOp.products([(4096, 768), (768, 768)])

    def ws(p, dtype=torch.bfloat16, row_sums=False, epilogue=None, out_dtype=None):
        found = [
            c
            for c in products_tuning.candidates(
                p,
                dtype=dtype,
                precision="tf32",
                has_bias=True,
                row_sums=row_sums,
                epilogue=epilogue,
                out_dtype=out_dtype,
            )  # fmt: skip
            if c["kernel"] == "ws"
        ]
        return found[0] if found else None

    assert ws(products["forward"]) == products_tuning._WS_CONFIG
    assert ws(products["grad_input"], torch.float16) == products_tuning._WS_CONFIG
    assert ws(products["grad_weight"], row_sums=True) == {**products_tuning._WS_CONFIG, "FUSED_SUMS": False}
    assert ws(products["grad_input"], epilogue="addend") == products_tuning._WS_CONFIG
    f32 = {**products_tuning._WS_CONFIG, "FUSED_SUMS": False}
    assert ws(products["grad_weight"], row_sums=True, out_dtype=torch.float32) == f32  # a master weight's dW and db
    assert ws(products["grad_input"], epilogue="addend", out_dtype=torch.float32) is None
    assert ws(products["forward"], torch.float32) is None
    assert ws(products["forward"], epilogue="activation") is None
    assert ws(products["grad_input"], epilogue="derivative") is None
    conv1d_dw = TransposedWeightLinearOp.products([(4096, 768), (768, 2304)])["grad_weight"]
    assert conv1d_dw.z_transposed and ws(conv1d_dw) is None
    unaligned = LinearOp.products([(4096, 768), (50257, 768)])["forward"]
    assert ws(unaligned) is None
    p = products["forward"]
    x, y, z = (torch.empty(n, dtype=torch.bfloat16) for n in (p.M * p.K, p.K * p.N, p.M * p.N))
    with pytest.raises(ValueError, match="matmul_ws computes half-precision"):
        products_launches._ws_launch(p, x, y, z.double(), None, torch.bfloat16, products_tuning._WS_CONFIG)
    with pytest.raises(ValueError, match="of float32 .without.*with a torch.bfloat16 addend"):
        products_launches._ws_launch(p, x, y, z.float(), None, torch.bfloat16, products_tuning._WS_CONFIG, z)
    with pytest.raises(ValueError, match="with a torch.float32 addend"):  # the addend of Z's half dtype only
        products_launches._ws_launch(p, x, y, z, None, torch.bfloat16, products_tuning._WS_CONFIG, z.float())
    with pytest.raises(ValueError, match="matmul_ws computes half-precision"):
        products_launches._ws_launch(conv1d_dw, x, y, z, None, torch.bfloat16, products_tuning._WS_CONFIG)
    assert products_launches.addend_epilogue(z).kind == "addend"
    with pytest.raises(ValueError, match="no activation epilogue"):
        h = products_launches.Epilogue(products_launches._Sum(), z)  # forwards: an activation storing h
        assert h.kind == "activation"
        products_launches.product_launches(
            p, products_tuning._WS_CONFIG, x=x, y=y, z=z, dtype=torch.bfloat16, precision="tf32",
            scratch=lambda s, d: torch.empty(s, dtype=d), epilogue=h,
        )  # fmt: skip
    unfused = {**products_tuning._WS_CONFIG, "FUSED_SUMS": False}
    launches = products_launches.product_launches(
        products["grad_weight"], unfused, x=x, y=y, z=z, dtype=torch.bfloat16, precision="tf32",
        scratch=lambda s, d: torch.empty(s, dtype=d), row_sums=torch.empty(768, dtype=torch.bfloat16),
    )  # fmt: skip
    assert launches[0].kernel is matmul_ws and len(launches) > 1  # then the column sums of dY
    assert launches[0].grid == (24,)  # dW 768 x 768: 6 x 4 tiles, a program each


# ------------------------------------------------------------------------------------ GPU


def _run_product(name, p, rows, fin, fout, dtype, gen, row_sums=False):
    a, b, expected, bias = _operands(name, rows, fin, fout, gen)
    dev = [t if t is None else t.to(dtype).to(teeny.DEVICE) for t in (a, b, bias)]
    z = torch.full(expected.shape, float("nan"), dtype=dtype, device=teeny.DEVICE)
    sums = torch.empty(a.shape[1], dtype=dtype, device=teeny.DEVICE) if row_sums else None
    config = {**products_tuning._WS_CONFIG, "FUSED_SUMS": False} if row_sums else products_tuning._WS_CONFIG
    scratch = lambda s, d: torch.empty(s, dtype=d, device=teeny.DEVICE)  # noqa: E731
    launches = products_launches.product_launches(
        p, config, x=dev[0], y=dev[1], z=z, bias=dev[2], dtype=dtype, precision="tf32", scratch=scratch, row_sums=sums
    )
    assert launches[0].kernel is matmul_ws
    run_launches(launches, dtype)
    atol, rtol = tolerance(dtype, max(expected.shape + a.shape))
    torch.testing.assert_close(z.cpu().double(), expected, atol=atol, rtol=rtol, msg=name)
    if row_sums:
        # X = dY^T: its rows' sums are dY's column sums, db
        torch.testing.assert_close(sums.cpu().double(), a.sum(0), atol=atol, rtol=rtol, msg=f"{name} row sums")


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [328, 4104], ids=["a_tile_each", "several_tiles_each"])
def test_kernel_computes_every_layout(dtype, rows, gen):
    """The four operand layouts, the bias, edges of every tile and of K (not multiples of
    128 x 192 x 64), Z filled with NaN first (every element must be written); 4,104 rows: 33 x 5
    tiles on 132 programs, so programs take a second tile (the stage ring and its phases carry on
    across tiles). dW with its row sums summed apart, as the tuning candidate does."""
    fin, fout = 136, 904
    for name, p in _products(rows, fin, fout).items():
        _run_product(name, p, rows, fin, fout, dtype, gen, row_sums=False)
    p = _products(rows, fin, fout)["grad_weight"]
    _run_product("grad_weight", p, rows, fin, fout, dtype, gen, row_sums=True)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [328, 4104], ids=["a_tile_each", "several_tiles_each"])
def test_kernel_adds_the_waiting_gradient_and_writes_float32_weight_gradients(dtype, rows, gen):
    """dX = dY W + the gradient waiting (``addend_epilogue``), over the waiting buffer and into a
    new one, rounded as the product stored alone and summed after (the addend's boxes are loaded
    by TMA as each tile starts; at 4,104 rows programs take a second tile and the addend
    barrier's phase carries on); dW written in float32 from the registers, not rounded to the
    operands' dtype, with db summed apart in float32."""
    fin, fout = 136, 904
    products = _products(rows, fin, fout)
    scratch = lambda s, d: torch.empty(s, dtype=d, device=teeny.DEVICE)  # noqa: E731
    shapes = ((rows, fout), (fout, fin), (rows, fin))
    dy, w, x = (torch.randn(*s, generator=gen).to(dtype).to(teeny.DEVICE) for s in shapes)
    waiting = torch.randn(rows, fin, generator=gen).to(dtype).to(teeny.DEVICE)
    expected = (dy.double() @ w.double()).to(dtype).double() + waiting.double()
    for in_place in (False, True):
        addend = waiting.clone()
        dx = addend if in_place else torch.full_like(addend, float("nan"))
        launches = products_launches.product_launches(
            products["grad_input"], products_tuning._WS_CONFIG, x=dy, y=w, z=dx, dtype=dtype, precision="tf32",
            scratch=scratch, epilogue=products_launches.addend_epilogue(addend),
        )  # fmt: skip
        assert [launch.kernel for launch in launches] == [matmul_ws]
        run_launches(launches, dtype)
        atol, rtol = tolerance(dtype, fout)
        torch.testing.assert_close(dx.double(), expected, atol=atol, rtol=rtol, msg=f"in place: {in_place}")
    dw = torch.full((fout, fin), float("nan"), device=teeny.DEVICE)
    db = torch.full((fout,), float("nan"), device=teeny.DEVICE)
    launches = products_launches.product_launches(
        products["grad_weight"], {**products_tuning._WS_CONFIG, "FUSED_SUMS": False}, x=dy, y=x, z=dw, dtype=dtype,
        precision="tf32", scratch=scratch, row_sums=db,
    )  # fmt: skip
    assert launches[0].kernel is matmul_ws
    run_launches(launches, dtype)
    expected = dy.double().T @ x.double()
    torch.testing.assert_close(dw.double(), expected, atol=1e-4 * rows**0.5, rtol=1e-5)
    torch.testing.assert_close(db.double(), dy.double().sum(0), atol=1e-4 * rows**0.5, rtol=1e-5)
    rounding = (expected - expected.to(dtype).double()).abs().max().item()
    assert (dw.double() - expected).abs().max().item() < rounding / 4  # not rounded to the operands' dtype


@gpu_only
def test_linears_of_one_input_train_through_matmul_ws_in_bf16_mixed(gen, monkeypatch):
    """bf16-mixed with x read by two linears, tuning made to pick matmul_ws wherever it is offered:
    the forwards, the first dX, the second dX adding the first's (the addend), and both float32
    dWs of the float32 master weights (``fusions.master_weights``) all go through it. Loss and
    gradients against torch autograd in float64, to bfloat16 accuracy."""
    monkeypatch.setattr(tuning, "enabled", lambda: True)
    tuning.forget_memory()
    picked = []

    def choose(kernel, key, candidates, default, bench, before_timing=None):
        ws = [c for c in candidates if c["kernel"] == "ws"]
        picked.append((key.get("epilogue"), key.get("out_dtype"), bool(ws)))
        return ws[0] if ws else default

    monkeypatch.setattr(tuning, "choose", choose)
    monkeypatch.setattr(products_tuning, "TUNE_MIN_MACS", 1)
    rows, fin, f1, f2 = 1000, 264, 520, 392
    feed = {
        "x": torch.randn(rows, fin, generator=gen).to(teeny.DEVICE),
        "w1": (torch.randn(f1, fin, generator=gen) / fin**0.5).to(teeny.DEVICE),
        "b1": torch.randn(f1, generator=gen).to(teeny.DEVICE),
        "w2": (torch.randn(f2, fin, generator=gen) / fin**0.5).to(teeny.DEVICE),
    }
    g = Graph()
    x, w1, b1, w2 = (g.input(n, t.shape, requires_grad=True) for n, t in feed.items())
    y1, y2 = teeny.ops.linear(x, w1, b1), teeny.ops.linear(x, w2)
    g.output(teeny.ops.add(teeny.ops.mean(teeny.ops.mul(y1, y1)), teeny.ops.mean(teeny.ops.mul(y2, y2))))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING, precision="bf16-mixed"))
    with record_launches() as log:
        loss, cache = ex.forward_train(feed)
        grads = ex.backward(cache)
    assert ("addend", None, True) in picked and (None, "float32", True) in picked
    assert all(ws for _, _, ws in picked), picked
    assert [r.kernel for r in log].count("matmul_ws") == 6  # 2 forwards, 2 dX, 2 dW
    refs = {n: t.double().requires_grad_(True) for n, t in feed.items()}
    r1 = torch.nn.functional.linear(refs["x"], refs["w1"], refs["b1"])
    r2 = torch.nn.functional.linear(refs["x"], refs["w2"])
    expected = (r1 * r1).mean() + (r2 * r2).mean()
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 2e-2 * abs(expected.item())
    for name, t in refs.items():
        assert grads[name].dtype == torch.float32, name
        assert (grads[name].double() - t.grad).norm() <= 2e-2 * t.grad.norm(), name
    tuning.forget_memory()


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_linear_trains_through_matmul_ws_like_torch(dtype, gen, monkeypatch):
    """A linear layer lowered for training with tuning made to pick matmul_ws for all three of
    its products: output and the gradients of x, W and b against torch autograd in float64."""
    monkeypatch.setattr(tuning, "enabled", lambda: True)
    tuning.forget_memory()
    picked = []

    def choose(kernel, key, candidates, default, bench, before_timing=None):
        ws = [c for c in candidates if c["kernel"] == "ws"]
        picked.append(bool(ws))
        return ws[0] if ws else default

    monkeypatch.setattr(tuning, "choose", choose)
    monkeypatch.setattr(products_tuning, "TUNE_MIN_MACS", 1)
    rows, fin, fout = 1000, 264, 520
    args = [
        torch.randn(rows, fin, generator=gen).to(dtype).to(teeny.DEVICE),
        (torch.randn(fout, fin, generator=gen) / fin**0.5).to(dtype).to(teeny.DEVICE),
        torch.randn(fout, generator=gen).to(dtype).to(teeny.DEVICE),
    ]
    g = Graph()
    xs, ws, bs = (g.input(n, t.shape, dtype, requires_grad=True) for n, t in zip("xwb", args))
    g.output(teeny.ops.linear(xs, ws, bs))
    ex = teeny.Executor(lower(g, LoweringMode.TRAINING))
    with record_launches() as log:
        out, cache = ex.forward_train(dict(zip("xwb", args)))
        grad = torch.randn(*out.shape, generator=gen).to(dtype).to(teeny.DEVICE)
        grads = ex.backward(cache, grad)
    assert picked == [True, True, True]
    assert [r.kernel for r in log].count("matmul_ws") == 3
    refs = [t.detach().double().requires_grad_(True) for t in args]
    ref = torch.nn.functional.linear(*refs)
    ref.backward(grad.double())
    atol, rtol = tolerance(dtype, rows)
    torch.testing.assert_close(out.double(), ref.detach(), atol=atol, rtol=rtol)
    for name, r in zip("xwb", refs):
        torch.testing.assert_close(grads[name].double(), r.grad, atol=atol, rtol=rtol, msg=name)
    tuning.forget_memory()
