"""`teeny export-hf` / `export_hf`: a native GPT as a transformers GPT2LMHeadModel folder with the
same logits (the head bias folded into ln_f and lm_head), the command's refusals and exit codes,
and the `--torch-model` state_dict written as safetensors."""

import json

import pytest
import torch

from teeny import ops
from teeny.cli import main
from teeny.core.graph import Graph
from teeny.program.executor import Executor
from teeny.program.lowering import LoweringMode, lower
from teeny.training.hf_export import CONFIG_NAME, WEIGHTS_NAME, ExportError, export_hf, fold_head_bias
from teeny.training.models import GPT, GPT_SIZES

VOCAB = 96  # CharCorpus.VOCAB


def _logits_executor(model: GPT, batch: int) -> Executor:
    g = Graph("gpt")
    g.output(model(g.input("x", (batch, model.block_size), torch.int64)))
    return Executor(lower(g, LoweringMode.INFERENCE))


def _hf_logits(directory, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(tokens).logits


def test_an_exported_gpt_gives_the_same_logits_in_transformers(tmp_path):
    model = GPT(VOCAB, block_size=8, d_model=16, n_heads=2, n_layers=2)
    ex = _logits_executor(model, batch=2)
    gen = torch.Generator().manual_seed(0)  # away from the initial ln weight 1 and biases 0: every term counts
    ex.load_params({k: v + 0.2 * torch.randn(v.shape, generator=gen).to(v.device) for k, v in ex.params.items()})
    tokens = torch.randint(0, VOCAB, (2, 8), generator=gen)
    assert export_hf(ex, tmp_path / "hf", spec={"n_heads": 2}) == tmp_path / "hf"
    config = json.loads((tmp_path / "hf" / CONFIG_NAME).read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert (config["n_embd"], config["n_head"], config["n_layer"], config["n_positions"]) == (16, 2, 2, 8)
    torch.testing.assert_close(
        _hf_logits(tmp_path / "hf", tokens), ex.forward({"x": tokens}).cpu(), rtol=1e-5, atol=1e-5
    )


def test_the_head_bias_fold_keeps_the_logits_of_every_normalised_row():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(50, 12, generator=gen, dtype=torch.float64), torch.randn(50, generator=gen, dtype=torch.float64)
    gamma, beta = 1 + torch.rand(12, generator=gen, dtype=torch.float64), torch.randn(12, generator=gen)
    beta = beta.double()
    x = torch.randn(30, 12, generator=gen, dtype=torch.float64)
    xhat = (x - x.mean(-1, keepdim=True)) / x.std(-1, unbiased=False, keepdim=True)
    folded_w, folded_beta = fold_head_bias(w, b, gamma, beta)
    torch.testing.assert_close((gamma * xhat + folded_beta) @ folded_w.T, (gamma * xhat + beta) @ w.T + b)
    assert fold_head_bias(w, torch.zeros(50, dtype=torch.float64), gamma, beta) == (w, beta)  # nothing to fold
    with pytest.raises(ExportError, match="near 0"):
        fold_head_bias(w, b, torch.cat([gamma[:-1], torch.zeros(1, dtype=torch.float64)]), beta)


def test_export_refuses_parameters_that_do_not_fit_the_spec(tmp_path):
    params = _logits_executor(GPT(VOCAB, 8, 16, 2, 1), batch=1).params
    with pytest.raises(ExportError, match="not of a gpt of size 'small'"):
        export_hf(params, tmp_path / "a", spec={"size": "small"})
    with pytest.raises(ExportError, match="does not divide"):
        export_hf(params, tmp_path / "b", spec={"n_heads": 3})
    with pytest.raises(ExportError, match="missing head.bias"):
        export_hf({k: v for k, v in params.items() if k != "head.bias"}, tmp_path / "c", spec={"n_heads": 2})
    assert not any(tmp_path.iterdir())  # refused before anything was written


def _trained_checkpoint(path):
    """A `teeny train gpt --size small` checkpoint after two AdamW steps on random tokens."""
    from teeny.training.loop import save_checkpoint
    from teeny.training.optim import AdamW

    model = GPT(VOCAB, **GPT_SIZES["small"])
    rows = 2 * model.block_size
    g = Graph("gpt")
    x, y = g.input("x", (2, model.block_size), torch.int64), g.input("y", (2, model.block_size), torch.int64)
    g.output(ops.cross_entropy(ops.reshape(model(x), (rows, VOCAB)), ops.reshape(y, (rows,))))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    optimizer = AdamW(ex, lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        _, cache = ex.forward_train({name: torch.randint(0, VOCAB, x.shape, generator=gen) for name in "xy"})
        ex.backward(cache)
        optimizer.step()
    save_checkpoint(path, ex, optimizer, 2, {"model": "gpt", "model_spec": {"size": "small"}})
    return model, ex.params


def test_the_export_hf_command_writes_a_checkpoint_and_refuses_a_full_folder(tmp_path, capsys):
    model, params = _trained_checkpoint(tmp_path / "checkpoint.safetensors")
    out = tmp_path / "hf"
    assert main(["export-hf", str(tmp_path / "checkpoint.safetensors"), "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    ex = _logits_executor(model, batch=1)
    ex.load_params(params)
    tokens = torch.randint(0, VOCAB, (1, model.block_size), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_hf_logits(out, tokens), ex.forward({"x": tokens}).cpu(), rtol=1e-5, atol=1e-5)
    capsys.readouterr()

    assert main(["export-hf", str(tmp_path / "checkpoint.safetensors"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not empty" in err and "--force" in err
    assert main(["export-hf", str(tmp_path / "checkpoint.safetensors"), "-o", str(out), "--force"]) == 0
    assert main(["export-hf", str(tmp_path / "missing.safetensors"), "-o", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_export_hf_refuses_a_checkpoint_of_another_model(tmp_path, capsys):
    from teeny.training.loop import save_checkpoint
    from teeny.training.models import MLP
    from teeny.training.optim import SGD

    g = Graph("mlp")
    g.output(ops.sum(MLP()(g.input("x", (2, 64), torch.float32))))
    ex = Executor(lower(g, LoweringMode.TRAINING))
    save_checkpoint(tmp_path / "mlp.safetensors", ex, SGD(ex, lr=0.1), 0, {"model": "mlp", "model_spec": {}})
    assert main(["export-hf", str(tmp_path / "mlp.safetensors"), "-o", str(tmp_path / "hf")]) == 2
    assert "only the native gpt" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


class _TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_the_torch_model_state_is_safetensors_and_loads_back_tied(tmp_path):
    from safetensors.torch import load_model

    from teeny.torch.task import save_torch_state

    torch.manual_seed(0)
    trained, fresh = _TiedLM(), _TiedLM()
    save_torch_state(trained, tmp_path / "torch_model.safetensors")
    assert (tmp_path / "torch_model.safetensors").read_bytes()[8:9] == b"{"  # a safetensors header, not a pickle
    load_model(fresh, tmp_path / "torch_model.safetensors")
    torch.testing.assert_close(fresh.state_dict(), trained.state_dict())
    assert fresh.head.weight is fresh.embed.weight
