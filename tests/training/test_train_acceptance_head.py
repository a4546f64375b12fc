"""The acceptance head's trainer: it learns from real replay records of moespec-tiny (the head it writes loads
and scores below an untrained head's BCE), takes the target from the records, and refuses records of two
model pairs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from trtllm_moespec import LLM, SamplingParams
from trtllm_moespec.models.acceptance_head import AcceptanceHead
from trtllm_moespec.replay.record import record
from trtllm_moespec.replay.records import ReplayFile
from trtllm_moespec.training import train_acceptance_head as trainer


@pytest.fixture(scope="module")
def records_path(tmp_path_factory):
    torch.set_num_threads(1)
    llm = LLM(model="moespec-tiny", policy="eagle3")
    ids = llm.encode(["def add(a, b):\n", "The capital of France is"])
    records, _ = record(llm, ids, [SamplingParams(max_tokens=24)] * 2, {"model": "moespec-tiny", "tree": [4, 8, 32]})
    return records.save(tmp_path_factory.mktemp("replay") / "train.safetensors")


@pytest.mark.parametrize("val", [False, True])  # a random 5% of the nodes, or records given to validate on
def test_the_trained_head_beats_an_untrained_one_on_its_examples(records_path, tmp_path, val):
    out = tmp_path / "out"
    export = tmp_path / "export"
    # a step budget, not a time budget: 3 s of training once ran 84 steps on a loaded CI machine, before the first
    # validation check at step 100, and kept the untrained head
    assert trainer.main(["--train", str(records_path), "--out", str(out), "--minutes", "5", "--max-steps", "200",
                         "--intermediate", "32", "--export", str(export)]
                        + (["--val", str(records_path)] if val else [])) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["val_files"] == ([str(records_path)] if val else [])
    assert metrics["steps"] == 200 and metrics["best_step"] in (100, 200) and metrics["val_bce"] < math.log(2.0)
    head = AcceptanceHead.load(export)
    assert head.config.intermediate_size == 32
    ex = trainer.collect(ReplayFile.load(records_path))
    assert len(ex) > 100 and 0.0 < float(ex.label.mean()) < 1.0  # the target accepted some drafted nodes, not all
    from trtllm_moespec.models.target import TargetModel
    from trtllm_moespec.resolve import resolve_model

    embed = TargetModel.load(resolve_model("moespec-tiny").target).input_embeddings()
    # an untrained head (zero output) scores ln 2; the trained one must have learnt at least the base rate
    assert trainer.heldout_loss(head.model, embed, ex) < 0.9 * math.log(2.0)


def test_records_of_two_model_pairs_cannot_train_one_head(records_path):
    tiny = ReplayFile.load(records_path)
    other = ReplayFile(tiny.arrays, {**tiny.meta, "model": "moespec-base"})
    assert trainer.records_model([tiny, tiny], ["a", "a"]) == ("moespec-tiny", None)
    with pytest.raises(ValueError, match="different models"):
        trainer.records_model([tiny, other], ["a", "b"])
