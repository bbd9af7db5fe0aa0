"""The support matrix of ``teeny.torch.patch`` (issue 49): 22 model types of ``transformers``, each
in each setting a training run meets, trains as the same model unpatched.

The model types are Liger-Kernel's list plus GPT-2, Starcoder2 and Cohere, each from a tiny config
(hidden 32, one layer, 4 heads of 8 over 2 KV heads, vocabulary 64; a MoE has 4 experts, top 2; no
dropout, no cache): float32, eager, SDPA attention where the model has it. Each cell is one
training step (batch 2 x 6 tokens) of the patched model against the same step of the same model
unpatched: the loss and every trainable parameter's gradient, to ``tolerance(float32, 64)``. A
module teeny cannot run is reported (``report.left``, ``report.fallbacks``) and runs the model's
own code, so every cell must match; none is skipped.

* ``train``: plain training; every module with weights is swapped or reported;
* ``checkpointing`` / ``checkpointing (reentrant)``: ``gradient_checkpointing_enable``, each
  decoder layer recomputed in the backward;
* ``pickle`` and ``deepcopy``: ``torch.save`` / ``torch.load(weights_only=False)`` of the patched
  model, then a copy of the loaded model, its weights then changed, trains with its own weights,
  and the original's stay as they were;
* ``LoRA then patch`` / ``patch then LoRA``: PEFT's LoRA (B non-zero, so every adapter counts) on
  the attention, the MLP (not a MoE's experts) and the head, added before or after ``patch``;
* ``compile`` / ``compile + bf16``: ``torch.compile(model, backend="teeny")``, the model
  unpatched, in float32 and under bf16 autocast (within bf16's rounding of eager's autocast);
* ``DDP`` / ``FSDP2``: two gloo ranks with half the batch each (FSDP2: ``fully_shard`` on each
  decoder layer, on the head apart and on the root) against one process with the whole batch
  unpatched. All model types run in one two-process group (``scripts/patch_matrix_ranks.py``),
  not a group each: 2 processes to start instead of 50.

README's support matrix is this file's table (the parts of ``report.coverage()``, which must name
teeny or PyTorch for each part a model has, and the cells):
``test_the_readme_support_matrix_is_this_files_table`` checks it under the pinned transformers
(constraints.txt), and ``TEENY_UPDATE_README=1 .venv/bin/python -m pytest tests/test_patch_matrix.py``
rewrites it from that run's results. ``make test`` runs the cells where the model's own code
meets patch's (training, checkpointing, the coverage) or the backend's (compile) a second time
under the GPU machine's transformers (``TEENY_TRANSFORMERS_VERSION`` names the version a run
must import); the GPU
suite (``make gpu-test``, under that version) runs the whole file.
"""

import contextlib
import copy
import functools
import io
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import teeny.torch as tt
from helpers import assert_same_step, shift_weights

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parents[1]
VERSION = transformers.__version__
PINNED = re.search(r"^transformers==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)[1]
VOCAB = 64

# offered to every config, which takes those it has (GPT-2's names, a MoE's, a sliding window
# shorter than the 6 tokens, token ids inside the vocabulary)
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=32, use_cache=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    attention_dropout=0.0, hidden_dropout=0.0, embedding_dropout=0.0, residual_dropout=0.0, mlp_dropout=0.0,
    n_embd=32, n_layer=1, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, sliding_window=4,
)  # fmt: skip

# model type -> the layers LoRA adapts besides lm_head: the attention's, and an MLP projection
# where the MLP is no MoE (a MoE's experts are one batched parameter, no Linear)
_QV = ("q_proj", "v_proj")
FAMILIES = {
    "llama": (*_QV, "gate_proj"),
    "mistral": (*_QV, "gate_proj"),
    "mixtral": _QV,
    "gemma": (*_QV, "gate_proj"),
    "gemma2": (*_QV, "gate_proj"),
    "gemma3_text": (*_QV, "gate_proj"),
    "qwen2": (*_QV, "gate_proj"),
    "qwen2_moe": _QV,
    "qwen3": (*_QV, "gate_proj"),
    "qwen3_moe": _QV,
    "phi3": ("qkv_proj", "gate_up_proj"),
    "granite": (*_QV, "gate_proj"),
    "olmo2": (*_QV, "gate_proj"),
    "olmo3": (*_QV, "gate_proj"),
    "glm4": (*_QV, "gate_up_proj"),
    "smollm3": (*_QV, "gate_proj"),
    "gpt_oss": _QV,
    "hunyuan_v1_dense": (*_QV, "gate_proj"),
    "exaone4": (*_QV, "gate_proj"),
    "gpt2": ("c_attn", "c_fc"),
    "starcoder2": (*_QV, "c_fc"),
    "cohere": (*_QV, "gate_proj"),
}
PARTS = ("norms", "attention", "rotary", "mlp", "block", "head + loss")  # of report.coverage()
CELLS = (
    "train", "checkpointing", "checkpointing (reentrant)", "deepcopy", "pickle",
    "LoRA then patch", "patch then LoRA", "DDP", "FSDP2", "compile", "compile + bf16",
)  # fmt: skip

_RESULTS: dict[tuple[str, str], bool] = {}  # (model type, cell) -> matched, for the README's table


@contextlib.contextmanager
def _cell(family: str, cell: str):
    """Record whether the checks of ``cell`` inside the block pass (README's table)."""
    _RESULTS[family, cell] = False
    yield
    _RESULTS[family, cell] = True


# ----------------------------------------------------------------------------- models and steps


@functools.cache
def _reference(family: str):
    """The unpatched model of ``family`` (seed 0): each cell patches a deep copy of it."""
    defaults = transformers.AutoConfig.for_model(family)
    config = transformers.AutoConfig.for_model(family, **{k: v for k, v in TINY.items() if hasattr(defaults, k)})
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    torch.manual_seed(0)
    attention = "sdpa" if model_class._supports_sdpa else "eager"  # Gemma-2, GPT-OSS: eager attention only
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)


def _model(family: str):
    return copy.deepcopy(_reference(family))


def _ids():
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))


def _step(model, ids=None):
    """The loss of one training call, and the gradient of each trainable parameter, by name."""
    ids = _ids() if ids is None else ids
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@functools.cache
def _expected(family: str):
    """One step of the unpatched model (the whole batch): what every cell of ``family`` but
    ``deepcopy`` and LoRA's compares with."""
    return _step(_model(family))


def _assert_matches(actual, expected, what: str):
    assert_same_step(actual, expected, f"transformers {VERSION}, {what}")


def _lora(model, family: str):
    """``model`` with LoRA adapters on ``FAMILIES[family]`` and ``lm_head``, B initialised non-zero."""
    peft = pytest.importorskip("peft")
    targets = [*FAMILIES[family], "lm_head"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fan_in_fan_out set for GPT-2's Conv1D; tied lm_head
        model = peft.get_peft_model(model, config)
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(targets), f"{family}: LoRA on {sorted(adapted)}, asked for {targets}"
    return model


@functools.cache
def _lora_expected(family: str):
    return _step(_lora(_model(family), family))


# ----------------------------------------------------------------------------- one process


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """PyTorch's own kernels on one thread while these tests run: on a busy machine a second
    thread waits longer than it works (an unpatched step took 0.4 s instead of 3 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_patched_model_trains_as_the_unpatched_one(family):
    """Every module with weights is swapped or reported as left to the model's own code."""
    with _cell(family, "train"):
        model = _model(family)
        report = tt.patch(model)
        reported = {path for path, _, _ in report.swapped} | {path for path, _, _ in report.left}
        weighted = {
            path
            for path, m in model.named_modules()
            if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))
        }
        assert weighted <= reported, f"{family}: neither swapped nor reported: {sorted(weighted - reported)}"
        _assert_matches(_step(model), _expected(family), f"{family}, patched")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_coverage_says_what_runs_each_part_the_model_has(family):
    """``report.coverage()`` (README's columns) names teeny or PyTorch for each part these models
    have (all but GPT-2's rotary embedding); "-" is for a part the model lacks."""
    coverage = getattr(tt.patch(_model(family)), "coverage", lambda: {})()
    lacking = {part for part, what in coverage.items() if what == "-"}
    assert lacking == ({"rotary"} if coverage and family == "gpt2" else set()), f"{family}: {coverage}"


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5.2x renamed it "activation_checkpointing"
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_recomputes_as_the_unpatched_model_computes(family, reentrant):
    """The Trainer's ``gradient_checkpointing=True``: each decoder layer runs again in the
    backward, outside the model's forward, on the kernels it ran on the first time."""
    with _cell(family, "checkpointing (reentrant)" if reentrant else "checkpointing"):
        model = _model(family)
        tt.patch(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        _assert_matches(_step(model), _expected(family), f"{family}, checkpointed (reentrant={reentrant})")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pickled_patched_model_loads_as_itself_and_its_deep_copy_has_its_own_weights(family):
    """``torch.save(model)`` and ``torch.load(weights_only=False)``: the same classes and report.
    ``copy.deepcopy`` (TRL's reference model, an EMA copy) of that model, whose weights then
    change: the copy, patched as the original is, trains as the unpatched model with those
    weights, and the original keeps its own. (One training step proves both: the copy is the
    loaded model's.)"""
    with _cell(family, "pickle"), _cell(family, "deepcopy"):
        model = _model(family)
        report = tt.patch(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert [type(m).__name__ for m in loaded.modules()] == [type(m).__name__ for m in model.modules()]
        assert loaded._teeny_report.swapped == report.swapped
        twin, twin_reference = copy.deepcopy(loaded), _model(family)
        assert [type(m) for m in twin.modules()] == [type(m) for m in loaded.modules()]
        assert twin._teeny_report is not loaded._teeny_report
        shift_weights(twin, twin_reference)
        _assert_matches(_step(twin), _step(twin_reference), f"{family}, unpickled, its copy")
        for (name, p), q in zip(loaded.named_parameters(), _reference(family).parameters()):
            assert torch.equal(p, q) and p.grad is None, f"{family}: the original's {name} changed"


@pytest.mark.parametrize("order", ["lora_then_patch", "patch_then_lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapters_count_whichever_comes_first(family, order):
    """PEFT's LoRA on the attention, the MLP and the head, before ``patch`` or after it: the loss
    and every adapter's gradient of the unpatched PEFT model (a one-call forward that reads an
    adapted layer's weight runs the layers' own calls instead)."""
    with _cell(family, order.replace("_", " ").replace("lora", "LoRA")):
        model = _model(family)
        if order == "patch_then_lora":
            tt.patch(model)
            model = _lora(model, family)
        else:
            model = _lora(model, family)
            tt.patch(model)
        _assert_matches(_step(model), _lora_expected(family), f"{family}, {order}")


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_with_the_teeny_backend_trains_as_eager(family, autocast):
    """``torch.compile(model, backend="teeny")``, unpatched: float32 as ``train`` is checked; under
    bf16 autocast, the logits in eager's dtype, the loss and each gradient within bf16's rounding
    of eager's under autocast. A MoE's router weights are scaled up there so that no token's
    choice of experts sits within bf16's rounding of a tie (which expert wins a tie is the
    rounding's choice, not the backend's)."""
    with _cell(family, "compile + bf16" if autocast else "compile"):
        torch._dynamo.reset()
        model, reference = _model(family), _model(family)
        ids = _ids()
        if not autocast:
            loss = torch.compile(model, backend="teeny")(input_ids=ids, labels=ids).loss
            loss.backward()
            grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
            _assert_matches((loss.detach(), grads), _expected(family), f"{family}, torch.compile(backend='teeny')")
            return
        for m in (model, reference):
            for name, p in m.named_parameters():
                if re.search(r"\.(gate|router)\.weight$", name):
                    p.data.mul_(8)
        with torch.autocast("cpu", torch.bfloat16):
            out = torch.compile(model, backend="teeny")(input_ids=ids, labels=ids)
            eager = reference(input_ids=ids, labels=ids)
        what = f"transformers {VERSION}, {family}, torch.compile(backend='teeny') under bf16 autocast"
        assert out.logits.dtype == eager.logits.dtype, what
        torch.testing.assert_close(out.loss, eager.loss, rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: loss: {m}")
        out.loss.backward()
        eager.loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            error = ((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12)).item()
            assert error < 5e-2, f"{what}: {name}: gradient off by {error:.3f} of its norm"


# ----------------------------------------------------------------------------- two ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The DDP and FSDP2 steps of every model type, from one two-process gloo group started as
    torchrun starts it: ``tests/scripts/patch_matrix_ranks.py``'s results."""
    folder = tmp_path_factory.mktemp("patch_matrix_ranks")
    command = [sys.executable, str(ROOT / "tests" / "scripts" / "patch_matrix_ranks.py"), str(folder / "out.pt")]
    port, procs = _free_port(), []
    for rank in range(2):
        env = {
            **os.environ,
            **dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"),
            **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TEENY_DEVICE="cpu", OMP_NUM_THREADS="1"),
        }
        with open(folder / f"rank{rank}.log", "w") as log:  # the process writes to its own handle
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, code in enumerate(codes):
        assert code == 0, f"rank {rank} exited with {code}:\n{(folder / f'rank{rank}.log').read_text()[-4000:]}"
    return torch.load(folder / "out.pt", weights_only=False)


def test_ddp_and_fsdp2_on_two_ranks_train_as_one_process_with_the_whole_batch(two_ranks):
    """Each rank trains the patched model on half the batch: DDP's averaged gradients, and
    FSDP2's shards put together, are the gradients of one unpatched process with the whole batch
    (the loss: the ranks' mean). FSDP2 shards the head apart from the root (with the embedding
    it is tied to), so the fused head + loss meets a head with FSDP's hooks."""
    assert two_ranks["transformers"] == VERSION
    failures = []
    for family in FAMILIES:
        for cell in ("DDP", "FSDP2"):
            result = two_ranks["results"][family, cell]
            try:
                with _cell(family, cell):
                    assert not isinstance(result, str), f"transformers {VERSION}, {family}, {cell}: {result}"
                    _assert_matches(result, _expected(family), f"{family}, {cell} on two ranks")
            except AssertionError as exc:
                failures.append("\n".join(str(exc).splitlines()[:8]))
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- README


def test_the_matrix_runs_under_the_transformers_version_asked_for(record_property):
    """``make test`` runs this file under two versions; each run imports the one it names."""
    record_property("transformers", VERSION)
    print(f"transformers {VERSION} from {transformers.__file__}")
    asked = os.environ.get("TEENY_TRANSFORMERS_VERSION")
    assert asked in (None, VERSION), f"transformers {VERSION} from {transformers.__file__}, {asked} asked for"


def _table(marks: dict[tuple[str, str], bool]) -> str:
    """README's support matrix: per model type what ``report.coverage()`` says of each part, and
    a mark per cell (a cell this process did not run is marked as passing: the test fails where
    it does not)."""
    escape = lambda text: str(text).replace("|", "\\|")
    lines = [
        f"Generated by `tests/test_patch_matrix.py` under transformers {VERSION}; ✓: the cell trains as the "
        "unpatched model (loss and every gradient), ✗: it does not.",
        "",
        "| model type | " + " | ".join(PARTS + CELLS) + " |",
        "|---" * (1 + len(PARTS) + len(CELLS)) + "|",
    ]
    for family in FAMILIES:
        coverage = getattr(tt.patch(_model(family)), "coverage", lambda: {})()
        row = [f"`{family}`", *(escape(coverage.get(part, "?")) for part in PARTS)]
        row += ["✓" if marks.get((family, cell), True) else "✗" for cell in CELLS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def test_the_readme_support_matrix_is_this_files_table():
    """README.md's table between the patch-matrix markers is ``_table`` of this run (runs last)."""
    if VERSION != PINNED:
        pytest.skip(f"README's matrix is of transformers {PINNED} (constraints.txt); this run has {VERSION}")
    start, end = "<!-- patch-matrix:start -->", "<!-- patch-matrix:end -->"
    readme = (ROOT / "README.md").read_text()
    assert start in readme and end in readme, f"README.md has no {start} ... {end}"
    head, rest = readme.split(start)
    written, tail = rest.split(end)
    table = f"\n{_table(_RESULTS)}\n"
    if os.environ.get("TEENY_UPDATE_README"):
        missing = [(family, cell) for family in FAMILIES for cell in CELLS if (family, cell) not in _RESULTS]
        assert not missing, f"rewrite it from a whole run of this file in one process (no -n, no -k): {missing[:3]} ..."
        (ROOT / "README.md").write_text(head + start + table + end + tail)
        written = table
    assert written == table, "README's support matrix is stale: TEENY_UPDATE_README=1 rewrites it"
