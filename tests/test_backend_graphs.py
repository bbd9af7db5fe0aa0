"""``torch.compile(backend="teeny")`` regions replayed as CUDA graphs (``teeny.torch.graphed``,
``teeny.core.config.cuda_graphs`` on): a training loop gives the same losses and gradients as the
same region replayed launch by launch, however the user holds on to what a step returned (the
loss and logits kept, gradients accumulated, two forwards before one backward, a parameter's
memory replaced)."""

from __future__ import annotations

import copy

import pytest
import torch

import teeny
from helpers import fresh_compile  # noqa: F401  (the fixture, used through pytestmark)
from teeny.core import config
from teeny.torch import backend, graphed

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("fresh_compile")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t, lambda t: t.t(), lambda t: t[:, ::2], lambda t: t[1:, 1:3], lambda t: t.expand(2, 3, 4),
        lambda t: t[:, None].expand(3, 5, 4), lambda t: t.as_strided((3, 3), (1, 1)),
        lambda t: t.as_strided((2, 2), (3, 2)), lambda t: t[:0], lambda t: t[:1, :1].expand(1, 6),
    ],
)  # fmt: skip
def test_an_input_that_overlaps_itself_is_told_apart_from_a_strided_one(make):
    """A moving input is copied into a graph's buffer only when no two of its elements share
    memory: checked against every element's offset (torch 2.11 has no Tensor method for it)."""
    view = make(torch.arange(12.0).reshape(3, 4))
    index = torch.zeros(view.shape, dtype=torch.long)
    for dim, (size, stride) in enumerate(zip(view.shape, view.stride())):
        shape = [1] * view.dim()
        shape[dim] = size
        index = index + (torch.arange(size) * stride).reshape(shape)
    assert graphed._overlaps_itself(view) == (index.unique().numel() < index.numel())


def _llama():
    torch.manual_seed(0)
    config_ = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config_).to(teeny.DEVICE)


def _batches(n: int):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 61, (2, 11), generator=generator).to(teeny.DEVICE) for _ in range(n)]


def _train(graphs: bool, steps, mode: str | None = None):
    """Run ``steps(compiled, model, optimizer)`` with CUDA graphs on or off (``config``) and
    torch.compile's ``mode``; returns what it returns, the region's forward and backward graph
    replays, and the backend's summary."""
    before, config.cuda_graphs = config.cuda_graphs, graphs
    try:
        model = _llama()
        compiled = torch.compile(model, backend="teeny", mode=mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        result = steps(compiled, model, optimizer)
        entry = backend.reports()[-1].live_entries()[0]
        graphed = (
            entry._forward_replay.graph_replays,
            sum(r.graph_replays for r in entry._backward_replays.values()),
        )
        return result, graphed, backend.summary(backend.reports())
    finally:
        config.cuda_graphs = before
        torch._dynamo.reset()
        backend.reset()


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _loop(compiled, model, optimizer, autocast=False):
    losses, kept = [], []
    for ids in _batches(6):
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = compiled(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss)  # kept as tensors, read after later steps ran
        kept.append(out.logits)
    return [*losses, *kept, *(p.detach().clone() for p in model.parameters())]


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@needs_gpu
def test_a_training_loop_runs_as_graphs_with_the_tapes_losses_and_weights(autocast):
    def steps(compiled, model, optimizer):
        return _loop(compiled, model, optimizer, autocast)

    expected, untouched, _ = _train(False, steps)
    actual, graphed, summary = _train(True, steps)
    assert untouched == (0, 0)
    assert graphed[0] >= 4 and graphed[1] >= 3, graphed  # both directions, once their inputs settled
    _assert_same(actual, expected)  # the losses and logits kept from every step, the final weights
    assert "forward as a CUDA graph" in summary and "backward as a CUDA graph" in summary, summary


@needs_gpu
def test_gradients_accumulated_over_micro_batches_and_two_forwards_before_a_backward():
    def steps(compiled, model, optimizer):
        grads = []
        batches = _batches(8)
        for k in range(0, 8, 4):
            optimizer.zero_grad()
            for ids in batches[k : k + 2]:  # accumulated: the second backward finds .grad held
                compiled(input_ids=ids, labels=ids).loss.backward()
            a, b = (compiled(input_ids=ids, labels=ids).loss for ids in batches[k + 2 : k + 4])
            (a + b).backward()  # two forwards before their backward: the first one's activations wait
            grads += [p.grad.clone() for p in model.parameters()]
            optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients zeroed in place and kept
        for ids in batches[:3]:
            compiled(input_ids=ids, labels=ids).loss.backward()
            grads += [p.grad.clone() for p in model.parameters()]
            optimizer.zero_grad(set_to_none=False)
        return grads

    expected, _, _ = _train(False, steps)
    actual, graphed, _ = _train(True, steps)
    assert graphed[0] > 0, graphed
    _assert_same(actual, expected)


@needs_gpu
def test_a_parameter_given_new_memory_is_read_there():
    """A graph reads its parameters where they were; one moved (``p.data = ...``, which dynamo
    does not guard) makes the region capture again, and the step reads the new values."""

    def steps(compiled, model, optimizer):
        losses = []
        for i, ids in enumerate(_batches(6)):
            if i == 3:
                with torch.no_grad():
                    model.lm_head.weight.data = model.lm_head.weight.data * 0.5  # new memory, new values
            optimizer.zero_grad()
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return losses

    expected, _, _ = _train(False, steps)
    actual, graphed, _ = _train(True, steps)
    assert graphed[0] >= 3, graphed
    _assert_same(actual, expected)


@needs_gpu
def test_no_grad_evaluation_between_steps_and_a_copy_of_the_model():
    def steps(compiled, model, optimizer):
        results = []
        for ids in _batches(5):
            optimizer.zero_grad()
            compiled(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            with torch.no_grad():
                results.append(compiled(input_ids=ids).logits)  # an inference program of its own
        twin = copy.deepcopy(model)  # another model's tensors: a program (and graphs) of their own
        results.append(torch.compile(twin, backend="teeny")(input_ids=ids, labels=ids).loss)
        return results

    expected, _, _ = _train(False, steps)
    actual, _, _ = _train(True, steps)
    _assert_same(actual, expected)


@needs_gpu
def test_mode_reduce_overhead_replays_as_graphs_with_the_switch_off():
    """``torch.compile(model, backend="teeny", mode="reduce-overhead")``: this model's region
    replays as CUDA graphs while ``config.cuda_graphs`` stays off, with the tapes' numbers."""

    def steps(compiled, model, optimizer):
        return _loop(compiled, model, optimizer, autocast=True)

    expected, untouched, _ = _train(False, steps)
    actual, graphed, summary = _train(False, steps, mode="reduce-overhead")
    assert untouched == (0, 0)
    assert graphed[0] >= 4 and graphed[1] >= 3, graphed
    _assert_same(actual, expected)
    assert "forward as a CUDA graph" in summary, summary
