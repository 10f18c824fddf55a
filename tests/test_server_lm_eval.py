"""lm-eval's `local-completions` model scoring a multiple-choice task against `kvblocks serve`.

The task is written here (nothing is downloaded). lm-eval asks for prompt log-probabilities
(`echo` + `logprobs`, `max_tokens` 1); each loglikelihood it reports must equal the sum of the
continuation's log-probabilities under the same model run in this process without any cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_proc import cli_env, start_server, stop_cleanly, tiny_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Rome"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five", "three"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": ["green", "blue", "red"], "answer": 1},
]
TASK = """task: kvblocks_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server():
    server = start_server("--model", str(tiny_model_dir()), "--served-model-name", "tiny")
    yield server
    stop_cleanly(server)


def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """lm-eval's own pairing: the continuation's ids are what the whole text adds to the context's."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    n = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.inference_mode():
        logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(n, len(whole)))


def test_lm_eval_loglikelihoods_equal_the_model_without_a_cache(server, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "kvblocks_mc.yaml").write_text(TASK.format(data=data))
    path = tiny_model_dir()
    model_args = (
        f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={path},num_concurrent=1,max_retries=1"
    )
    lm_eval = Path(sys.executable).with_name("lm_eval")
    proc = subprocess.run(
        [str(lm_eval), "--model", "local-completions", "--model_args", model_args, "--tasks", "kvblocks_mc",
         "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"), "--log_samples"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env=cli_env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = [
        json.loads(line)
        for f in (tmp_path / "out").rglob("samples_*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert len(samples) == len(DOCS)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    for sample in samples:
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            assert float(resp[0][0]) == pytest.approx(
                loglikelihood(model, tokenizer, context, continuation), abs=1e-3
            )
