"""Ahead-of-time bundles (teeny.aot), checked without a GPU.

Bundles of the MLP and the char GPT (small) are built for sm_90 and sm_80 in both modes, on
this machine: the kernel list is the program's launches, an inference bundle holds no backward
kernel, bad targets and versions are refused, and the loader's whole path (binaries placed in
Triton's caches, Triton's own lookup at each launch) runs against an emulated GPU of each
target (``teeny.aot.verify``): no compilation, and every launch runs the binary and grid the
plan names. Running the binaries needs the GPU: bench/aot.py.

Compiled kernels are shared within the session through one Triton cache folder.
"""

import contextlib
import json
import os
import zipfile

import pytest
import torch

import teeny
from teeny import aot
from teeny.aot.bundle import BundleError, Target, check_versions, parse_targets, select_target
from teeny.cli import main
from teeny.core.kernel import REGISTRY, intercept_launches
from teeny.training.models import MLP

TARGETS = "cuda:90,cuda:80"


def shared_folder(request, tmp_path_factory, name):
    """A folder for the session: under pytest-xdist one that every worker shares (the first
    worker to get there fills it, the others wait for it), else a fresh temporary one."""
    if not hasattr(request.config, "workerinput"):
        return tmp_path_factory.mktemp(name), contextlib.nullcontext()
    from filelock import FileLock

    folder = tmp_path_factory.getbasetemp().parent / name
    folder.mkdir(exist_ok=True)
    return folder, FileLock(str(folder) + ".lock")


@pytest.fixture(scope="module")
def triton_cache(request, tmp_path_factory):
    old = os.environ.get("TRITON_CACHE_DIR")
    folder, _ = shared_folder(request, tmp_path_factory, "triton-cache")
    os.environ["TRITON_CACHE_DIR"] = str(folder)
    yield
    if old is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = old


def tiny_graph():
    """A graph traced here, under the interpreter, with the MLP's shapes (so that most of its
    kernels are the MLP's, compiled once) and its own loss."""
    g = teeny.Graph("tiny")
    x = g.input("x", (64, 64))
    y = g.input("y", (64,), torch.int64)
    g.output(teeny.ops.cross_entropy(MLP()(x), y))
    return g


@pytest.fixture(scope="module")
def bundles(request, triton_cache, tmp_path_factory):
    """Every bundle of the module, built in one worker process (training first: the inference
    bundles' kernels are then found in the Triton cache), once per session."""
    folder, lock = shared_folder(request, tmp_path_factory, "bundles")
    keys = [("mlp", "training"), ("gpt", "training"), ("mlp", "inference"), ("gpt", "inference")]
    items = [(model, folder / f"{model}-{mode}.teeny", {"target": TARGETS, "mode": mode}) for model, mode in keys]
    items.append((tiny_graph(), folder / "tiny.teeny", {"target": TARGETS, "train": {"optimizer": "sgd"}}))
    with lock:
        if not (folder / "done").exists():
            aot.build_many(items)
            (folder / "done").touch()
    return dict(zip([*keys, "graph"], [path for _, path, _ in items]))


@pytest.fixture(scope="module")
def verified(bundles):
    """The loader's path on an emulated GPU of each target, for three of the bundles."""
    keys = [("gpt", "training"), ("mlp", "inference"), "graph"]
    return dict(zip(keys, aot.verify([bundles[k] for k in keys])))


def plans(path):
    bundle = aot.Bundle(path)
    return {name: bundle.plan(name) for name in bundle.target_names()}


def launches(plan):
    return [launch for run in plan["runs"].values() for launch in run]


@pytest.mark.slow
def test_bundles_hold_both_targets_with_their_versions(bundles):
    for key, path in bundles.items():
        manifest = aot.Bundle(path).manifest
        assert (manifest["name"], manifest["mode"]) == (("tiny", "training") if key == "graph" else key)
        assert [(t["name"], t["arch"], t["sm_count"]) for t in manifest["targets"]] == [
            ("cuda:90", 90, 132),
            ("cuda:80", 80, 108),
        ]
        assert manifest["teeny_version"] == teeny.__version__
        assert manifest["config"]["check_indices"] is False  # the GPU's default, not the interpreter's
        assert (manifest["train"] is not None) == (manifest["mode"] == "training")


@pytest.mark.slow
def test_kernel_list_is_the_programs_launches(bundles):
    waiting = set()
    for path in bundles.values():
        archive = zipfile.ZipFile(path)
        for name, plan in plans(path).items():
            kernels = {k["id"]: k for k in plan["kernels"]}
            used = {launch["binary"] for launch in launches(plan)}
            assert used == set(kernels), name  # no binary nobody launches, no launch without one
            # the lowering's kernel instances are exactly those the node launches use (plus accumulate)
            node_kernels = {
                f"{launch['kernel']}[{launch['dtype']}]"
                for launch in launches(plan)
                if launch["phase"] in ("forward", "backward", "accumulate")
            }
            assert node_kernels == set(plan["program"]["kernel_instances"])
            # one binary per distinct specialisation of a kernel, each with its cubin and PTX
            assert len({(k["kernel"], tuple(k["float64_scalars"]), k["key"]) for k in kernels.values()}) == len(kernels)
            arch = plan["arch"]
            for k in kernels.values():
                assert archive.read(k["files"]["cubin"])[:4] == b"\x7fELF"
                ptx = archive.read(k["files"]["ptx"]).decode()
                assert f".target sm_{arch}" in ptx
                # programmatic dependent launch: the products and attention wait for the kernel
                # before them on sm_90; sm_80 has no such instruction
                waits = getattr(REGISTRY.get(k["kernel"]), "pdl", False) and arch >= 90
                assert ("griddepcontrol.wait" in ptx) == waits, (name, k["kernel"])
                if waits:
                    waiting.add((arch, k["kernel"]))
    assert {(90, "matmul_tma"), (90, "attention_forward"), (90, "attention_backward_dkdv")} <= waiting


@pytest.mark.slow
def test_training_bundles_hold_the_step_and_its_optimizer(bundles):
    plan = plans(bundles["gpt", "training"])["cuda:90"]
    assert list(plan["runs"]) == ["train_step", "accumulate_step", "forward"]
    phases = [launch["phase"] for launch in plan["runs"]["train_step"]]
    assert phases.index("backward") > phases.index("forward")
    assert phases[-1] == "optimizer" and "clip" in phases  # the char GPT clips at 1.0
    assert {launch["phase"] for launch in plan["runs"]["accumulate_step"]} >= {"accumulate"}
    by_name = {k["kernel"] for k in plan["kernels"]}
    assert {"adam_step_kernel", "clip_factor_kernel", "accumulate_kernel", "attention_backward_dq"} <= by_name
    # packed arguments name their buffers: the weights live in the parameter arena at their offsets
    offsets = {p["name"]: p["offset"] for p in plan["program"]["params"]}
    buffers = {b["id"]: b["label"] for b in plan["buffers"]}
    node = next(n["name"] for n in plan["program"]["nodes"] if "head.weight" in n["inputs"])
    head = next(launch for launch in plan["runs"]["forward"] if f"'{node}'" in launch["where"])
    # (the arena starts with the parameter the backward writes first, the head's weight: its offset is
    # 0, which a scratch buffer's arguments have too, so look for the arena argument)
    at_offset = [a for a in head["args"] if a.get("offset") == offsets["head.weight"] and "buffer" in a]
    assert "parameters float32" in {buffers[a["buffer"]] for a in at_offset}


@pytest.mark.slow
def test_inference_bundles_hold_no_backward_kernel(bundles):
    # a kernel may be one op's forward and another's backward (strided_copy: transpose's forward,
    # advanced indexing's backward; matmul_tma: on the GPU both): what counts is that every kernel
    # an inference bundle holds runs in a forward launch, and that it holds no backward launch
    for model in ("mlp", "gpt"):
        inference = plans(bundles[model, "inference"])
        training = plans(bundles[model, "training"])
        for name, plan in inference.items():
            assert list(plan["runs"]) == ["forward"]
            kinds = {k["kernel"] for k in plan["kernels"]}
            assert all(k["phases"] == ["forward"] for k in plan["kernels"])
            trained = {k["kernel"] for k in training[name]["kernels"]}
            assert kinds < trained and trained - kinds >= {"adam_step_kernel", "accumulate_kernel"}


@pytest.mark.slow
def test_loader_runs_every_launch_on_its_binary_with_no_compilation(verified):
    """The loader's path as on the GPU, with a driver that records launches instead of running them."""
    for key, results in verified.items():
        assert [r["target"] for r in results] == ["cuda:90", "cuda:80"]
        for r in results:
            assert r["compilations"] == [], key
            assert all(r["runs_match"].values()) and r["grids_match"], key
            assert r["unused_binaries"] == []
            if "strict_refusal" in r:  # training: a launch of another specialisation is refused, not compiled
                assert "holds no binary for this launch of accumulate_kernel" in r["strict_refusal"]


@pytest.mark.slow
def test_a_graph_traced_here_is_stored_with_its_parameters(bundles):
    """A Graph traced under the interpreter is stored by reference to its kernels and rebuilt
    with the GPU's (verified above); its initialisers are closures, so its initial parameters
    are stored, and the optimizer asked for is the one compiled."""
    bundle = aot.Bundle(bundles["graph"])
    assert bundle.manifest["source"] == {"kind": "graph", "name": "tiny", "file": "graph.pkl"}
    assert bundle.manifest["params"] == "params.safetensors" and bundle.has("params.safetensors")
    assert bundle.manifest["train"]["optimizer"] == "sgd"
    kernels = {k["kernel"] for k in bundle.plan("cuda:90")["kernels"]}
    assert "sgd_step_kernel" in kernels and "adam_step_kernel" not in kernels


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "text, message",
    [
        ("rocm:90", "only CUDA targets"),
        ("cuda:9x", "expected cuda:ARCH"),
        ("cuda:70", "7.5 and newer"),
        ("cuda:86", "no usual SM count"),
        ("cuda:90@0", "SM count must be >= 1"),
    ],
)
def test_bad_targets_are_refused(text, message):
    with pytest.raises(BundleError, match=message):
        Target.parse(text)


def test_targets_parse_with_their_sm_counts():
    assert parse_targets("cuda:90, cuda:86@84") == [Target(90, 132), Target(86, 84)]
    with pytest.raises(BundleError, match="given twice"):
        parse_targets("cuda:90,cuda:90@114")


MANIFEST = {
    "format": "teeny-bundle",
    "format_version": 1,
    "teeny_version": "0.1.0",
    "triton_version": "3.6.0",
    "targets": [{"name": "cuda:90", "arch": 90, "sm_count": 132}, {"name": "cuda:80", "arch": 80, "sm_count": 108}],
}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("format_version", 2, "format version 2"),
        ("teeny_version", "0.0.9", "built by teeny 0.0.9"),
        ("triton_version", "3.5.1", "compiled by Triton 3.5.1"),
    ],
)
def test_other_versions_are_refused(field, value, message):
    check_versions(MANIFEST, "0.1.0", "3.6.0")
    with pytest.raises(BundleError, match=message):
        check_versions({**MANIFEST, field: value}, "0.1.0", "3.6.0")


def test_the_loader_picks_the_gpus_target_or_refuses():
    assert select_target(MANIFEST, 80, 108) == (MANIFEST["targets"][1], None)
    entry, warning = select_target(MANIFEST, 90, 114)  # H100 PCIe: another SM count, said
    assert entry["name"] == "cuda:90" and "planned for 132 SMs, this GPU has 114" in warning
    with pytest.raises(BundleError, match="holds kernels for cuda:90, cuda:80, but this GPU is cuda:86"):
        select_target(MANIFEST, 86, 84)


@pytest.mark.slow
def test_load_refuses_damaged_and_foreign_files(bundles, tmp_path):
    junk = tmp_path / "junk.teeny"
    junk.write_bytes(b"not a zip")
    with pytest.raises(BundleError, match="not a teeny bundle"):
        aot.load(junk)
    doctored = tmp_path / "old.teeny"
    with zipfile.ZipFile(bundles["mlp", "inference"]) as src, zipfile.ZipFile(doctored, "w") as dst:
        for name in src.namelist():
            data = src.read(name)
            if name == "manifest.json":
                data = json.dumps({**json.loads(data), "triton_version": "3.5.0"}).encode()
            dst.writestr(name, data)
    with pytest.raises(BundleError, match="compiled by Triton 3.5.0"):
        aot.load(doctored)
    if teeny.DEVICE.type == "cpu":
        with pytest.raises(BundleError, match="needs the GPU"):
            aot.load(bundles["mlp", "inference"])


@pytest.mark.slow
def test_build_command(bundles, tmp_path, capsys):
    """``teeny build`` writes a bundle (the MLP's inference kernels are in the session's Triton
    cache by now) and refuses bad arguments before starting any worker."""
    out = tmp_path / "mlp.teeny"
    argv = ["build", "mlp", "--mode", "inference", "--batch-size", "16", "--target", "cuda:90", "--params", "init"]
    assert main([*argv, "-o", str(out)]) == 0
    assert "cuda:90@132: 3 kernels" in capsys.readouterr().out
    bundle = aot.Bundle(out)
    assert bundle.manifest["source"] == {"kind": "model", "model": "mlp", "size": "small", "batch_size": 16}
    from safetensors.torch import load

    from teeny.program.executor import Executor
    from teeny.program.lowering import lower
    from teeny.training.models import make_task

    stored = load(bundle.read(bundle.manifest["params"]))  # the initial parameters, as the JIT path makes them
    expected = Executor(lower(make_task("mlp")._graph(16, False)), seed=0, device="cpu").state_dict()
    assert stored.keys() == expected.keys() and all(torch.equal(stored[k], expected[k]) for k in stored)
    assert main(["build", "mlp", "--target", "rocm:90", "-o", str(tmp_path / "x.teeny")]) == 2
    assert "only CUDA targets" in capsys.readouterr().err
    assert main(["build", "resnet", "-o", str(tmp_path / "x.teeny")]) == 2
    assert "unknown model 'resnet'" in capsys.readouterr().err
    assert not (tmp_path / "x.teeny").exists()


def test_intercepted_launches_run_nothing():
    """What the build relies on: inside intercept_launches a launch reaches the handler, with the
    arguments in signature order, and no kernel runs."""
    from teeny.program.accumulate import accumulate

    a, b, out = torch.ones(5), torch.ones(5), torch.zeros(5)
    seen = []
    with intercept_launches(lambda instance, jit, grid, args, options: seen.append((instance.kernel.name, args))):
        accumulate(a, b, out)
    assert torch.equal(out, torch.zeros(5))
    ((name, args),) = seen
    assert name == "accumulate_kernel" and args[:3] == [a, b, out] and args[3] == 5


def test_integers_that_change_between_runs_are_reported():
    """A specialised integer argument that differs between runs (a host counter) may need a
    binary a later run will not find; one that is not specialised (do_not_specialize, spec None)
    may vary freely."""
    from teeny.aot.capture import varying_specialisations

    def launch(seed, spec):
        return {
            "where": "op dropout (node 'd', forward)",
            "kernel": "k",
            "args": [{"name": "seed", "value": seed, "spec": spec}],
        }

    assert varying_specialisations({"a": [launch(3, None)], "b": [launch(8, None)]}) == []
    (warning,) = varying_specialisations({"a": [launch(1, 1)], "b": [launch(16, "D")]})
    assert "argument 'seed' takes the values [1, 16]" in warning


@pytest.mark.skipif(teeny.DEVICE.type != "cuda", reason="runs the compiled kernels: needs the GPU")
@pytest.mark.slow
def test_a_loaded_bundle_trains_like_the_jit_path_with_no_compilation(bundles):
    from teeny.program.executor import Executor
    from teeny.program.lowering import LoweringMode, lower
    from teeny.training.loop import TrainConfig, TrainStep, make_optimizer

    with aot.count_compilations() as compiled:
        bundle = aot.load(bundles["mlp", "training"])
        batch = bundle.manifest["source"]["batch_size"]
        feeds = [feed for _, feed in zip(range(3), bundle.task.batches(0, batch, 0))]
        losses = [float(bundle.step(feed)) for feed in feeds]
    assert compiled == []
    train = bundle.manifest["train"]
    executor = Executor(lower(bundle.task.train_graph(batch), LoweringMode.TRAINING), seed=0)
    config = TrainConfig(**{k: train[k] for k in ("optimizer", "lr", "weight_decay", "momentum")})
    step = TrainStep(executor, make_optimizer(executor, config), train["clip"], cuda_graph=True)
    assert [float(step(feed)) for feed in feeds] == losses


def test_build_refuses_an_unwritable_bundle_path_before_compiling(tmp_path, capsys, monkeypatch):
    """`-o EXISTING_FOLDER` used to compile for minutes, then fail on the rename and leave a
    255 KB .tmp beside the folder."""

    def no_worker(request):
        raise AssertionError("compiled before checking where the bundle goes")

    monkeypatch.setattr(aot, "_run_worker", no_worker)
    folder, file = tmp_path / "bundles", tmp_path / "file"
    folder.mkdir()
    file.write_text("x")
    for out, message in [(folder, "it is a folder"), (file / "mlp.teeny", "which is a file")]:
        assert main(["build", "mlp", "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and str(out) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundles", "file"] and not any(folder.iterdir())


def test_a_bundle_write_that_fails_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    """Past the checks (here skipped), a write that fails, e.g. on a full disk, is one line and
    removes its temporary file."""
    plan = {"kernels": [], "runs": {}, "compile_seconds": 0.0, "warnings": []}
    job = {"files": {}, "plans": [plan], "versions": {"triton": "t", "torch": "p"}, "source": {}, "config": {}}
    monkeypatch.setattr(aot, "_run_worker", lambda request: {"jobs": [{**job, "train": {}}]})
    monkeypatch.setattr(aot, "_check_out", lambda out, name: None, raising=False)
    out = tmp_path / "taken"
    out.mkdir()  # the rename onto it fails, as a full disk fails the write
    assert main(["build", "mlp", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


_HASH_ORDER = """
import sys
from teeny.aot.worker import emulate_cuda
emulate_cuda(90, 132)
from teeny.core.kernel import settle
from teeny.ops.activation import maths
order = sys.argv[1:]
for name in order:  # Triton's own hash, in this order: a caller hashed before its callee misses its globals
    getattr(maths, name).cache_key
print(settle(maths._softcap), settle(maths._gelu_tanh))
"""


def test_settled_kernel_keys_do_not_depend_on_the_order_a_process_hashed_them():
    """A bundle names each kernel by its Triton key and its launches by keys that include the
    activation passed as a constexpr: a loading process must compute the same ones, whichever
    kernels it hashed first (``_softcap`` calls ``_tanh``, which reads two constexpr globals)."""
    import subprocess
    import sys

    keys = set()
    for order in ([], ["_softcap"], ["_tanh", "_softcap"], ["_gelu_tanh", "_softcap", "_tanh"]):
        run = subprocess.run([sys.executable, "-c", _HASH_ORDER, *order], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        keys.add(run.stdout.strip())
    assert len(keys) == 1
