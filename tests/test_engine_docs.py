"""The engine's docstrings and comments name things that exist and describe the policy the code has."""
import re
from pathlib import Path

import nanovllm_ref
from nanovllm_ref.engine import scheduler
from nanovllm_ref.engine.block_manager import BlockManager

SRC = Path(nanovllm_ref.__file__).parent


def test_block_manager_methods_named_in_the_engine_exist():
    named = {(path.name, m) for path in SRC.rglob("*.py")
             for m in re.findall(r"BlockManager\.(\w+)", path.read_text())}
    missing = sorted((f, m) for f, m in named if not hasattr(BlockManager, m))
    assert not missing, f"engine sources name BlockManager methods that do not exist: {missing}"


def test_scheduler_docstring_names_its_policy():
    """Prefill-first, all-prefill or all-decode steps: vLLM V0's default plus chunking, not V0's chunked-prefill
    scheduler (decode-first, mixed) nor V1's (mixed under one token budget)."""
    doc = scheduler.__doc__
    assert "V0's scheduler with chunked prefill" not in doc and "V0 scheduler with chunked prefill" not in doc
    for phrase in ("prefill-first", "decode-first", "V1", "one token budget", "Chapter 07"):
        assert phrase in doc, phrase
