"""Foundation checks: subspace exactness, split equivalence, HF interop, manifest errors."""

import pytest
import torch

from agora.config import ManifestError, load_manifest, parse_manifest
from agora.hf import export_state_dict, hf_config_kwargs, import_state_dict
from agora.model import PipelineModel, Stage, count_parameters
from agora.wire import bytes_per_token, compress, decompress, relative_reconstruction_error


def tiny(mode="subspace", stages=(2, 2), **over):
    m = load_manifest("tiny")
    changes = {"residual.mode": mode, "stages": list(stages), "model.n_layers": sum(stages)}
    if mode == "dense":
        changes["residual.k"] = None
    changes.update(over)
    return m.with_overrides(**changes)


def batch(man, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, man.model.vocab_size, (b, man.model.seq_len + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def test_subspace_exact_after_every_stage():
    man = tiny(stages=(1, 1, 1, 1))
    model = PipelineModel(man)
    tokens, _ = batch(man)
    x = tokens
    for stage in model.stages[:-1]:
        x = stage(x)
        err = relative_reconstruction_error(x, tokens, stage.basis, stage.frozen_embed)
        assert err < 1e-6, err  # measured 1.6e-7 .. 5.6e-7 (tiny, small) in fp32 on CPU: exact up to rounding


def test_unconstrained_write_breaks_exactness():
    """Control: one dense (unconstrained) write matrix makes the same check fail."""
    man = tiny(stages=(2, 2))
    stage = Stage(man, 0)
    tokens, _ = batch(man)
    rogue = torch.nn.Linear(man.model.d_model, man.model.d_model, bias=False)
    torch.nn.init.normal_(rogue.weight, std=0.02)
    # The block additionally writes rogue(x) into the residual, not lifted by U^T.
    stage.layers["1"].register_forward_hook(lambda mod, inp, out: out + rogue(inp[0]))
    x = stage(tokens)
    err = relative_reconstruction_error(x, tokens, stage.basis, stage.frozen_embed)
    assert err > 1e-2, err


def test_frozen_embedding_orthogonal_to_basis():
    stage = Stage(tiny(), 0)
    assert (stage.frozen_embed @ stage.basis).abs().max() < 1e-5
    eye = stage.basis.T @ stage.basis
    assert torch.allclose(eye, torch.eye(eye.shape[0]), atol=1e-5)


def test_stage_built_alone_equals_slice_of_full_model():
    man = tiny()
    full = PipelineModel(man)
    alone = Stage(man, 1)
    for (n1, p1), (n2, p2) in zip(full.stages[1].named_parameters(), alone.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


@pytest.mark.parametrize("mode", ["dense", "subspace"])
def test_split_equivalence_loss_and_grads(mode):
    man = tiny(mode=mode, stages=(1, 2, 1))
    ref = PipelineModel(man)
    split = PipelineModel(man)
    split.load_state_dict(ref.state_dict())
    tokens, targets = batch(man)

    ref_loss = ref.loss(tokens, targets)
    ref_loss.backward()

    # Chain the stages through compress -> decompress with detached boundaries, as peers do.
    inputs, outputs = [], []
    x = tokens
    for i, stage in enumerate(split.stages):
        if i > 0:
            boundary = compress(x.detach(), tokens, stage.basis, "fp32")
            boundary.coords.requires_grad_(True)
            inputs.append(boundary)
            x = decompress(boundary, stage.basis, stage.frozen_embed)
        x = stage(x)
        outputs.append(x)
    loss = split.stages[-1].loss(x, targets)
    assert torch.allclose(loss, ref_loss, atol=1e-5)
    loss.backward()
    for i in range(len(split.stages) - 2, -1, -1):
        # Sender side: d loss / d x_out = (d loss / d coords) lifted back through compress.
        out = outputs[i]
        wire = compress(out, tokens, split.stages[i + 1].basis, "fp32").coords
        wire.backward(inputs[i].coords.grad)
    for (name, p_ref), (_, p_split) in zip(ref.named_parameters(), split.named_parameters()):
        assert p_ref.grad is not None, name
        assert torch.allclose(p_ref.grad, p_split.grad, atol=1e-5), name


def test_boundary_bytes_and_dtypes():
    man = tiny()
    stage = Stage(man, 0)
    tokens, _ = batch(man)
    x = stage(tokens)
    b16 = compress(x, tokens, stage.basis, "bf16")
    assert b16.coords.dtype == torch.bfloat16 and b16.tokens.dtype == torch.int32
    k, d = man.residual.k, man.model.d_model
    assert b16.nbytes == tokens.numel() * (2 * k + 4) == tokens.numel() * bytes_per_token(d, "subspace", k, "bf16")
    dense = compress(x, tokens, None, "fp32")
    assert dense.nbytes == tokens.numel() * (4 * d + 4)
    # bf16 coordinates still rebuild x closely (relative rounding ~ 2^-8).
    rebuilt = decompress(b16, stage.basis, stage.frozen_embed)
    assert ((rebuilt - x).abs().max() / x.abs().max()) < 1e-2


def test_token_ids_survive_the_wire_above_fp16_range():
    man = tiny()
    stage = Stage(man, 1)
    tokens = torch.tensor([[4095, 2049, 3001, 7]])
    b = compress(torch.zeros(1, 4, man.model.d_model), tokens, stage.basis, "bf16")
    assert torch.equal(b.tokens.long(), tokens)


def test_hf_logits_match_and_weights_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    man = tiny(mode="dense", stages=(2, 2))
    cfg = transformers.LlamaConfig(**hf_config_kwargs(man))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ours = PipelineModel(man).eval()
    import_state_dict(ours, hf.state_dict())
    tokens, _ = batch(man)
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
    diff = (ref - got).abs().max().item()
    assert diff < 1e-4 and diff / ref.abs().max().item() < 1e-5, diff  # absolute and relative to the logits' scale
    exported = export_state_dict(ours)
    hf_state = {k: v for k, v in hf.state_dict().items() if not k.endswith("inv_freq")}
    assert set(exported) == set(hf_state)
    assert all(torch.equal(exported[k], hf_state[k]) for k in hf_state)
    # safetensors round trip into a fresh model
    from agora.hf import load_hf_safetensors, save_hf_safetensors

    save_hf_safetensors(ours, tmp_path / "model.safetensors")
    fresh = PipelineModel(man)
    load_hf_safetensors(fresh, tmp_path / "model.safetensors")
    with torch.no_grad():
        assert torch.equal(fresh(tokens), ours(tokens))


def test_subspace_model_refuses_hf_import():
    with pytest.raises(ValueError, match="dense"):
        import_state_dict(PipelineModel(tiny()), {})


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"residual": {"mode": "subspace", "k": 999}}, "residual.k"),
        ({"stages": [1, 1, 1, 1, 1]}, "stages"),
        ({"bogus": 1}, "bogus: unknown key"),
        ({"model": "wide"}, "model"),
        ({"seed": "abc"}, "seed"),
        ({"residual": {"mode": "subspace"}}, "residual.k is required"),
        ({"batch": {"microbatch_size": 8, "target_batch_size": 4}}, "target_batch_size"),
    ],
)
def test_manifest_errors_name_the_field(change, needle):
    _assert_manifest_error(change, needle)


def _assert_manifest_error(change: dict, needle: str) -> None:
    data = load_manifest("tiny").model_dump(mode="json")
    data.update(change)
    with pytest.raises(ManifestError) as err:
        parse_manifest(data, "test.yaml")
    assert needle in str(err.value), str(err.value)


def test_manifest_hash_is_stable_and_content_sensitive(tmp_path):
    a = load_manifest("tiny")
    path = tmp_path / "m.yaml"
    path.write_text(a.to_yaml())
    assert load_manifest(path).hash == a.hash
    assert a.with_overrides(**{"optimizer.lr": 0.01}).hash != a.hash


def test_averaging_section_defaults_validates_and_enters_the_hash(tmp_path):
    base = load_manifest("tiny")
    assert base.averaging.scheme == "full"
    # A default section is left out of the hash: manifests and checkpoints from before it existed still match.
    assert '"averaging"' not in base.canonical_json()
    psgd = base.with_overrides(**{"averaging.scheme": "powersgd", "averaging.rank": 8})
    assert psgd.hash != base.hash and psgd.hash != base.with_overrides(**{"averaging.scheme": "powersgd"}).hash
    path = tmp_path / "m.yaml"
    path.write_text(psgd.to_yaml())
    assert load_manifest(path).hash == psgd.hash and load_manifest(path).averaging.rank == 8
    # dense_every came later: left out of the hash while 0, so PowerSGD manifests from before it keep theirs
    assert '"dense_every"' not in psgd.canonical_json()
    periodic = psgd.with_overrides(**{"averaging.dense_every": 10})
    assert '"dense_every":10' in periodic.canonical_json() and periodic.hash != psgd.hash
    sparse = base.with_overrides(**{"averaging.scheme": "sparse", "averaging.rho": 0.1, "averaging.every": 5})
    assert (sparse.averaging.rho, sparse.averaging.every) == (0.1, 5)
    for preset in ("tiny", "small", "agora-8b"):
        assert load_manifest(preset).averaging.scheme == "full"


def test_sparse_rounds_every_step_unless_told_while_diloco_keeps_its_h(tmp_path):
    """``every``'s default is the scheme's: 1 for SPARTA (measured: every 4 steps cost 3.2% of loss at 409,600
    tokens of small), 20 for DiLoCo's and gossip's inner phases. An explicit value always wins and survives the
    round trip through YAML and the canonical JSON (the hash)."""
    base = load_manifest("tiny")
    assert base.with_overrides(averaging={"scheme": "sparse"}).averaging.every == 1
    assert base.with_overrides(averaging={"scheme": "sparse", "rho": 0.1}).averaging.every == 1
    assert base.with_overrides(averaging={"scheme": "diloco"}).averaging.every == 20
    assert base.with_overrides(averaging={"scheme": "gossip"}).averaging.every == 20
    for every in (1, 4, 20):
        m = base.with_overrides(averaging={"scheme": "sparse", "every": every})
        path = tmp_path / f"m{every}.yaml"
        path.write_text(m.to_yaml())
        again = load_manifest(path)
        assert again.averaging.every == every and again.hash == m.hash
    assert (base.with_overrides(averaging={"scheme": "sparse"}).hash
            != base.with_overrides(averaging={"scheme": "sparse", "every": 20}).hash)


@pytest.mark.parametrize("change,needle", [
    ({"averaging": {"scheme": "topk"}}, "averaging.scheme"),
    ({"averaging": {"scheme": "powersgd", "rank": 0}}, "averaging.rank"),
    ({"averaging": {"scheme": "sparse", "rho": 0}}, "averaging.rho"),
    ({"averaging": {"scheme": "sparse", "every": 0}}, "averaging.every"),
    ({"averaging": {"scheme": "full", "rank": 8}}, "only apply to scheme 'powersgd'"),
    ({"averaging": {"scheme": "sparse", "dense_steps": 3}}, "only apply to scheme 'powersgd'"),
    ({"averaging": {"scheme": "full", "dense_every": 10}}, "only apply to scheme 'powersgd'"),
    ({"averaging": {"scheme": "powersgd", "dense_every": -1}}, "averaging.dense_every"),
    ({"averaging": {"scheme": "powersgd", "dense_steps": -1}}, "averaging.dense_steps"),
    ({"averaging": {"scheme": "powersgd", "rho": 0.1}}, "only applies to scheme 'sparse'"),
    ({"averaging": {"scheme": "full", "ranks": 8}}, "unknown key"),
    ({"averaging": {"scheme": "full", "agreement_tolerance": -1e-4}}, "averaging.agreement_tolerance"),
    ({"averaging": {"scheme": "full", "agreement_tolerance": 0.5}}, "averaging.agreement_tolerance"),
    ({"averaging": {"scheme": "sparse", "agreement_tolerance": 1e-3}}, "only applies to schemes 'full' and"),
])
def test_bad_averaging_section_is_a_clear_error(change, needle):
    _assert_manifest_error(change, needle)


def test_malformed_yaml_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run_id: [unclosed\n")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(path)


def test_a_binary_file_or_a_folder_as_manifest_is_a_clear_error(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes([0xF9, 0x00, 0xFF, 0x80]) * 64)
    with pytest.raises(ManifestError, match="not a UTF-8 text file"):
        load_manifest(path)
    with pytest.raises(ManifestError, match="is a folder: pass its manifest.yaml"):
        load_manifest(tmp_path)


def test_cli_refuses_ports_gpu_sizes_and_output_folders_that_cannot_exist(tmp_path):
    from typer.testing import CliRunner

    from agora.cli import app

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    runner = CliRunner()
    for args, option in ((["node", "--manifest", "tiny", "--port", "70000"], "--port"),
                         (["bootstrap", "--port", "-1"], "--port"),
                         (["node", "--manifest", "tiny", "--metrics-port", "65536"], "--metrics-port"),
                         (["plan", "--manifest", "tiny", "--gpu-gb", "-3"], "--gpu-gb"),
                         # a result folder that cannot be written is refused before the run, not after it
                         (["bench", "upm", "--out", str(blocker / "results")], "--out"),
                         (["train-local", "--manifest", "tiny", "--out", str(blocker)], "--out")):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert f"Invalid value for '{option}'" in result.output, result.output


def test_8b_preset_validates_and_reports_size():
    man = load_manifest("agora-8b")
    n = count_parameters(man)["total"]
    assert 5e9 < n < 9e9
    assert man.model.d_model / bytes_per_token(4096, "subspace", 40, "bf16") * 4 > 100  # >100x vs dense fp32


def _with(section: str, **fields) -> dict:
    """A ``tiny`` manifest section with ``fields`` changed (for ``_assert_manifest_error``)."""
    data = load_manifest("tiny").model_dump(mode="json")[section]
    data.update(fields)
    return {section: data}


@pytest.mark.parametrize(
    "change, needle",
    [
        (_with("optimizer", lr=float("inf")), "optimizer.lr: Input should be a finite number"),
        (_with("optimizer", grad_clip=float("nan")), "optimizer.grad_clip: Input should be a finite number"),
        (_with("optimizer", weight_decay=float("inf")), "optimizer.weight_decay: Input should be a finite number"),
        (_with("model", norm_eps=float("inf")), "model.norm_eps: Input should be a finite number"),
        (_with("optimizer", betas=[0.9, 1.0]), "optimizer.betas [0.9, 1.0] must each be in [0, 1)"),
        (_with("optimizer", betas=[-0.5, 0.9]), "optimizer.betas"),
        ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
        ({"seed": 2**64}, "seed: Input should be less than"),
        (_with("model", vocab_size=10**12), "model.vocab_size: Input should be less than or equal to"),
        (_with("batch", microbatch_size=10**9), "batch.microbatch_size"),
        (_with("model", d_model=2**18, n_heads=2**10, n_kv_heads=2**10, ffn_dim=2**18, n_layers=4,
               vocab_size=2**24), "beyond any machine"),
    ],
)
def test_manifest_refuses_what_cannot_train_naming_the_field(change, needle):
    _assert_manifest_error(change, needle)


def test_a_stage_larger_than_the_machine_is_refused_before_it_is_allocated(tmp_path):
    """``agora train-local`` (and ``agora node``, via ``roles.check_memory``) compare the stage's memory needs
    with what the machine has before building anything."""
    import subprocess
    import sys

    import psutil

    from agora.model import stage_memory_bytes
    from agora.roles import check_memory
    from agora.net.dht import JoinError

    big = load_manifest("agora-8b")
    assert stage_memory_bytes(big, 0) > 16 * 2**30  # an 8B model's head stage in fp32 with AdamW: > 16 GiB
    assert stage_memory_bytes(load_manifest("tiny"), 0) < 2**30
    if stage_memory_bytes(big) > psutil.virtual_memory().available:
        proc = subprocess.run([sys.executable, "-m", "agora.cli", "train-local", "--manifest", "agora-8b",
                               "--steps", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
        said = " ".join((proc.stdout + proc.stderr).split())  # rich wraps long lines
        assert proc.returncode == 2 and "GiB of memory" in said and "available" in said, said
        with pytest.raises(JoinError, match="GiB of memory"):
            check_memory(big, 5)
    check_memory(load_manifest("tiny"), 0)  # fits: no error
