"""What the engine's sleep saves in the ahead-of-time memory reports (`sleep_savings` of
scripts/tpu/aot_compile.py), from the committed reports in docs/aot/: no compile, no libtpu."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORTS = sorted((ROOT / "docs" / "aot").glob("*.json"))


@pytest.fixture(scope="module")
def aot():
    spec = importlib.util.spec_from_file_location("aot_compile", ROOT / "scripts" / "tpu" / "aot_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.stem)
def test_sleep_saves_the_kv_cache_and_the_engine_weights_in_every_training_peak(aot, path):
    report = json.loads(path.read_text())
    sleep = aot.sleep_savings(report)
    res, engine = report["resident_bytes"], report["engine"]
    assert not engine["zero_copy_sync"] and not engine["cross_mesh_sync"]  # colocated, own weight copy
    # the compiled decode state is the engine's KV cache plus its small per-slot buffers
    kv = sleep["kv_cache_bytes"]
    assert kv == engine["kv_cache_bytes_global"] // report["chips"]
    assert kv <= sleep["released_bytes"]["decode_state"] <= kv * 1.001
    assert sleep["released_bytes"]["engine_params"] == res["engine_params"] > 0
    saved = res["decode_state"] + res["engine_params"]
    assert set(sleep["programs"]) == {"actor_update", "log_prob"}
    for name, e in sleep["programs"].items():
        program = report["programs"][name]
        # the engine's state was among the residents beside the program, and is what sleep frees
        assert program["other_resident_bytes"] >= saved
        assert e["saved_bytes"] == saved >= kv + res["engine_params"]
        assert e["peak_asleep_bytes"] == program["peak_bytes"] - saved > program["program_bytes"]
        assert e["fits_asleep"] == (e["peak_asleep_bytes"] <= report["chip"]["hbm_bytes"])


def test_zero_copy_and_separate_placement(aot):
    """A zero-copy engine has no weights of its own to free; a rollout on other devices has
    nothing beside the update."""
    report = json.loads(REPORTS[0].read_text())
    shared = dict(report, engine={**report["engine"], "zero_copy_sync": True})
    sleep = aot.sleep_savings(shared)
    assert sleep["released_bytes"]["engine_params"] == 0
    assert sleep["programs"]["actor_update"]["saved_bytes"] == report["resident_bytes"]["decode_state"]
    assert aot.sleep_savings(dict(report, engine={**report["engine"], "cross_mesh_sync": True})) is None


def test_the_table_has_a_sleep_row_per_colocated_report(aot):
    reports = [json.loads(p.read_text()) for p in REPORTS]
    table = aot.markdown_tables(reports).split("\n\n")[-1].splitlines()
    assert "saved by sleep" in table[0] and len(table) == 2 + len(reports)
    r = reports[0]
    s = aot.sleep_savings(r)
    gib = lambda n: f"{n / (1 << 30):.1f}"  # noqa: E731
    up = s["programs"]["actor_update"]
    assert f"| {gib(sum(s['released_bytes'].values()))} | {gib(up['peak_bytes'])} -> " \
           f"{gib(up['peak_asleep_bytes'])} |" in table[2]
