"""subquad.data.pretrained: the loaders leave the caller's Hugging Face settings alone and print no
progress bar."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from subquad.data import pretrained


def test_the_gguf_reader_draws_no_bar_inside_and_is_restored_after(capsys):
    gguf = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    before = gguf.tqdm
    with pretrained._no_gguf_progress_bar():
        for _ in gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert gguf.tqdm is before
    assert "de-quantizing" not in capsys.readouterr().err


def _run(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter with no Hugging Face offline switch set, and a hub address
    that answers nothing (a download attempt would fail, not reach the network)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow  # loads the model in a subprocess
def test_load_minilm_leaves_the_hub_online():
    """The loader reads local files only and switches nothing off for the rest of the process."""
    if pretrained.minilm_missing():
        pytest.skip(f"needs {pretrained.minilm_missing()}")
    proc = _run("import os, huggingface_hub.constants as c\n"
                "from subquad.data.pretrained import load_minilm\n"
                "tok, model = load_minilm()\n"
                "print(os.environ.get('HF_HUB_OFFLINE'), os.environ.get('TRANSFORMERS_OFFLINE'), c.HF_HUB_OFFLINE)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "None", "False"]


@pytest.mark.slow  # de-quantises SmolLM2 in a subprocess (about 30 s on 2 cores)
def test_load_smollm_prints_no_progress_bar():
    if pretrained.smollm_missing():
        pytest.skip(f"needs {pretrained.smollm_missing()}")
    proc = _run("import os\nfrom subquad.data.pretrained import load_smollm\ntok, model = load_smollm()\n"
                "print(os.environ.get('HF_HUB_OFFLINE'))")
    assert proc.returncode == 0, proc.stderr
    assert "de-quantizing" not in proc.stderr and "%|" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.split() == ["None"]
