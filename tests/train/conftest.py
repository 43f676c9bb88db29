from __future__ import annotations

from pathlib import Path

import pytest

from subquad.tasks import listops


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """200 / 40 / 40 short ListOps samples (lengths 6..59)."""
    out = tmp_path_factory.mktemp("listops")
    cfg = listops.GeneratorConfig(max_depth=4, max_args=5, min_length=5, max_length=60)
    listops.write_splits(out, listops.generate_splits(200, 40, 40, seed=0, config=cfg))
    return out
