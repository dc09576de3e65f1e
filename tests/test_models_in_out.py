"""Models in and out: tied embeddings, import of Hugging Face folders into stage checkpoints, export of trained
stages to a folder transformers loads, and the eval / generate commands on them."""

import json

import pytest
import torch
from typer.testing import CliRunner

from agora.cli import app
from agora.config import load_manifest
from agora.hf import hf_config_kwargs
from agora.model import PipelineModel, Stage, count_parameters
from agora.ops.model_io import gather_from_checkpoints, load_model, merge_stages
from agora.server.checkpoint import load_stage_checkpoint, save_stage_checkpoint

transformers = pytest.importorskip("transformers")

DENSE = load_manifest("tiny").with_overrides(**{"residual.mode": "dense", "residual.k": None,
                                                 "residual.wire_dtype": "fp32"})
TIED = DENSE.with_overrides(**{"model.tie_embeddings": True})
runner = CliRunner()


def _said(res) -> str:
    """The command's output on one line (rich wraps long messages at the terminal width)."""
    return " ".join(res.output.split())


def _save_stages(root, manifest, stages, step=3):
    for stage in stages:
        names = [f"param/{n}" for n, _ in stage.named_parameters()]
        save_stage_checkpoint(root, manifest, stage.spec.index, step, names, [p.detach() for _, p in
                                                                             stage.named_parameters()])
    (root / "manifest.yaml").write_text(manifest.to_yaml())


def _perturbed_stages(manifest, seed=1):
    """Stages as a swarm leaves them: trained away from their init (here: noise), each stage on its own."""
    gen = torch.Generator().manual_seed(seed)
    stages = [Stage(manifest, s) for s in range(manifest.n_stages)]
    with torch.no_grad():
        for stage in stages:
            for _, p in stage.named_parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return stages


def _hf_logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def test_tied_manifest_keeps_untied_hashes_and_refuses_subspace():
    assert "tie_embeddings" not in DENSE.canonical_json()  # manifests written before the field keep their hash
    assert TIED.hash != DENSE.hash
    with pytest.raises(ValueError, match="tie_embeddings needs residual.mode: dense"):
        load_manifest("tiny").with_overrides(**{"model.tie_embeddings": True})


def test_tied_model_shares_one_matrix_in_one_process_and_starts_equal_in_a_swarm():
    model = PipelineModel(TIED)
    head, tail = model.stages[0], model.stages[-1]
    assert tail.lm_head.weight is head.embed_tokens.weight
    n = sum(p.numel() for p in model.parameters())
    assert n == count_parameters(TIED)["total"]
    assert n == count_parameters(DENSE)["total"] - TIED.model.vocab_size * TIED.model.d_model
    # A tail built alone (a peer) holds its own copy, equal to the head's at initialisation.
    alone = Stage(TIED, TIED.n_stages - 1)
    assert torch.equal(alone.lm_head.weight, Stage(TIED, 0).embed_tokens.weight)
    # Gradients of both uses land in the one matrix.
    tokens = torch.randint(0, TIED.model.vocab_size, (2, 16))
    model.loss(tokens, tokens).backward()
    assert head.embed_tokens.weight.grad is not None and tail.lm_head.weight.grad is head.embed_tokens.weight.grad


@pytest.mark.parametrize("manifest", [DENSE, TIED], ids=["untied", "tied"])
def test_export_from_checkpoints_loads_in_transformers_with_equal_logits(tmp_path, manifest):
    stages = _perturbed_stages(manifest)
    if manifest.model.tie_embeddings:  # a swarm that kept its two copies equal
        with torch.no_grad():
            stages[-1].lm_head.weight.copy_(stages[0].embed_tokens.weight)
    _save_stages(tmp_path / "ck", manifest, stages)
    res = runner.invoke(app, ["export", "--from", str(tmp_path / "ck"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is manifest.model.tie_embeddings
    tokens = torch.randint(0, manifest.model.vocab_size, (2, manifest.model.seq_len))
    ours = merge_stages(manifest, stages).eval()
    with torch.no_grad():
        expected = ours(tokens)
    torch.testing.assert_close(_hf_logits(tmp_path / "out", tokens), expected, atol=1e-4, rtol=0)
    # ... and agora loads its own export to the same logits.
    loaded = load_model(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(tokens), expected, atol=1e-5, rtol=0)


def test_a_tied_swarm_whose_copies_drifted_exports_untied_losing_nothing(tmp_path):
    stages = _perturbed_stages(TIED)  # head and tail copies now differ
    assert not torch.equal(stages[0].embed_tokens.weight, stages[-1].lm_head.weight)
    model = merge_stages(TIED, stages)
    assert not model.manifest.model.tie_embeddings
    assert torch.equal(model.stages[0].lm_head.weight, stages[-1].lm_head.weight)
    assert torch.equal(model.stages[0].embed_tokens.weight, stages[0].embed_tokens.weight)


def test_subspace_export_round_trips_through_agoras_own_format(tmp_path):
    manifest = load_manifest("tiny")
    stages = _perturbed_stages(manifest)
    _save_stages(tmp_path / "ck", manifest, stages)
    res = runner.invoke(app, ["export", "--from", str(tmp_path / "ck"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "out" / "config.json").exists()  # not a transformers model: no config pretending so
    tokens = torch.randint(0, manifest.model.vocab_size, (2, manifest.model.seq_len))
    with torch.no_grad():
        expected = merge_stages(manifest, stages)(tokens)
        got = load_model(tmp_path / "out").model(tokens)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def _hf_folder(tmp_path, tied: bool, shard: bool):
    """A tiny random Llama saved by transformers itself, with the run's tokenizer."""
    from agora.data import get_tokenizer

    manifest = TIED if tied else DENSE
    cfg = transformers.LlamaConfig(**hf_config_kwargs(manifest))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path / ("hf-tied" if tied else "hf")
    hf.save_pretrained(str(folder), max_shard_size="100KB" if shard else "5GB")
    get_tokenizer(manifest.data, manifest.model.vocab_size).save(str(folder / "tokenizer.json"))
    return hf, folder


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_hf_folder_round_trips_to_equal_logits(tmp_path, tied):
    hf, folder = _hf_folder(tmp_path, tied, shard=tied)
    if tied:
        assert (folder / "model.safetensors.index.json").exists()  # the sharded layout is exercised
    res = runner.invoke(app, ["import", "--from", str(folder), "--out", str(tmp_path / "run"), "--stages", "1,2,1",
                              "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    manifest = load_manifest(tmp_path / "run" / "manifest.yaml")
    assert manifest.stages == [1, 2, 1] and manifest.model.tie_embeddings is tied and manifest.model.seq_len == 32
    # Each stage checkpoint is what `agora node --resume` loads: this manifest's hash, step 0, param/ names.
    for s in range(3):
        step, names, _ = load_stage_checkpoint(tmp_path / "run", manifest, s)
        assert step == 0 and all(n.startswith("param/") for n in names)
    tokens = torch.randint(0, manifest.model.vocab_size, (2, 32))
    with torch.no_grad():
        expected = hf(tokens).logits
        stages, _ = gather_from_checkpoints(manifest, tmp_path / "run")
        torch.testing.assert_close(merge_stages(manifest, stages)(tokens), expected, atol=1e-4, rtol=0)
    # ... and export gives transformers back the same model.
    res = runner.invoke(app, ["export", "--from", str(tmp_path / "run"), "--out", str(tmp_path / "back")])
    assert res.exit_code == 0, res.output
    torch.testing.assert_close(_hf_logits(tmp_path / "back", tokens), expected, atol=1e-4, rtol=0)


def test_import_refusals_are_one_clear_line(tmp_path):
    _, folder = _hf_folder(tmp_path, tied=False, shard=False)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (folder / "config.json").write_text(json.dumps(config))
    res = runner.invoke(app, ["import", "--from", str(folder), "--out", str(tmp_path / "run")])
    assert res.exit_code == 2 and "rope_scaling" in _said(res), res.output
    res = runner.invoke(app, ["import", "--from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")])
    assert res.exit_code == 2 and "error" in _said(res), res.output
    config["rope_scaling"] = None
    (folder / "config.json").write_text(json.dumps(config))
    res = runner.invoke(app, ["import", "--from", str(folder), "--out", str(tmp_path / "run"), "--stages", "3,3"])
    assert res.exit_code == 2 and "adds up to 6 layers" in _said(res), res.output
    assert not (tmp_path / "run" / "manifest.yaml").exists()  # nothing half-written that looks complete


def test_eval_and_generate_commands_on_an_exported_model(tmp_path):
    stages = _perturbed_stages(DENSE)
    _save_stages(tmp_path / "ck", DENSE, stages)
    assert runner.invoke(app, ["export", "--from", str(tmp_path / "ck"), "--out", str(tmp_path / "m")]).exit_code == 0
    res = runner.invoke(app, ["eval", "--model", str(tmp_path / "m"), "--tokens", "2000", "--json",
                              str(tmp_path / "eval.json")])
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "eval.json").read_text())
    assert 0 < result["tokens"] <= 2000 and result["perplexity"] == pytest.approx(2.718281828 ** result["loss"],
                                                                                   rel=1e-6)
    res = runner.invoke(app, ["generate", "--model", str(tmp_path / "m"), "--prompt", "The Union", "--max-new-tokens",
                              "5"])
    assert res.exit_code == 0 and res.stdout.startswith("The Union"), res.output
    res = runner.invoke(app, ["generate", "--model", str(tmp_path / "m"), "--prompt", "The Union", "--max-new-tokens",
                              "500"])
    assert res.exit_code == 2 and "new tokens fit" in _said(res), res.output
    res = runner.invoke(app, ["eval", "--model", str(tmp_path / "nothing-here")])
    assert res.exit_code == 2 and "does not exist" in _said(res), res.output
