"""`benchmarks/bench_batch_steps.py` on moespec-tiny: the static batch and the served queue (`--requests`)
decode every request to its length, and every method's greedy tokens equal `ar`'s."""

from __future__ import annotations

import json

from benchmarks import bench_batch_steps


def _cells(tmp_path, *extra: str) -> dict:
    out = tmp_path / "steps.json"
    bench_batch_steps.main(["--model", "moespec-tiny", "--batch-sizes", "1,2", "--methods", "ar,joint-batch,eagle3",
                            "--tokens", "6", "--repeats", "1", "--json", str(out), *extra])
    report = json.loads(out.read_text())
    return report, {(c["method"], c["batch"]): c for c in report["cells"]}


def test_served_queue_is_exact_and_speculates(tmp_path):
    report, cells = _cells(tmp_path, "--requests", "4")
    assert report["requests"] == 4
    assert set(cells) == {(m, b) for m in ("ar", "joint-batch", "eagle3") for b in (1, 2)}
    assert all(c["exact"] for c in cells.values())
    assert cells["eagle3", 2]["speculative_steps"] > 0 and cells["ar", 2]["speculative_steps"] == 0
    assert all(c["full_batch_tokens_per_s"] > 0 and c["tokens_per_s"] > 0 for c in cells.values())


def test_dataset_prompts_take_the_data_sets_in_turn():
    from trtllm_moespec import LLM
    from trtllm_moespec.bench.datasets import encode_prompt, load_prompts

    llm = LLM("moespec-tiny", policy="ar")
    limit = llm.target.max_position_embeddings - 8
    expect = [encode_prompt(load_prompts(ds, 2)[i].text, llm.tokenizer, llm.target.vocab_size, limit)
              for i in range(2) for ds in ("humaneval", "mt_bench", "gsm8k")][:5]
    assert bench_batch_steps._dataset_prompts(llm, 5, 8) == expect


def test_served_run_counts_every_request(tmp_path):
    from trtllm_moespec import LLM, SamplingParams
    from trtllm_moespec.engine.batch import BatchedEngine

    llm = LLM("moespec-tiny", policy="eagle3")
    prompts = bench_batch_steps._dataset_prompts(llm, 3, 5)
    run = bench_batch_steps._serve(llm, BatchedEngine(llm.engine, 2), prompts, 2,
                                   SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(o) for o in run.outputs] == [5, 5, 5]
    assert run.speculative_steps > 0
    expected = [llm.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids for p in prompts]
    assert [list(o) for o in run.outputs] == [list(e) for e in expected]
