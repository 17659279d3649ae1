"""scripts/bench_pack_shapes.py --tiny: the padded and packed layouts of one set of short rows
hold the same real tokens, the packed ones in fewer computed tokens, each timed."""
import json


def test_bench_pack_shapes_tiny_layouts(tmp_path, load_script):
    bench = load_script("bench_pack_shapes")
    out = tmp_path / "shapes.json"
    bench.main(["--tiny", "--rows", "12", "--row-len", "20", "--padded-len", "48", "--pack-lens", "64",
                "--repeats", "1", "--out", str(out)])
    records = json.loads(out.read_text())
    padded, packed = records
    assert (padded["mode"], packed["mode"]) == ("padded", "packed")
    assert padded["real_tokens"] == packed["real_tokens"] == 12 * 20
    assert padded["sequences"] == 12 and padded["tokens_computed"] == 12 * 48
    assert packed["rows_per_sequence"] == 3 and packed["sequences"] == 4 and packed["tokens_computed"] == 4 * 64
    assert all(r["median_s"] > 0 for r in records)


def test_layout_places_rows_end_to_end(load_script):
    bench = load_script("bench_pack_shapes")
    ids, seg, pos, per = bench.layout(5, 3, 8)
    assert per == 2 and seg.shape == (3, 8)
    assert seg[0].tolist() == [1, 1, 1, 2, 2, 2, 0, 0] and pos[0].tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    assert seg[2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
