"""A search point as a key (``search/keys.py``): its (name, value written out) pairs in name
order, each pair one object shared by every key that holds it."""

from __future__ import annotations

from stage_cosim.search import keys
from stage_cosim.search.keys import point_key


def test_a_key_is_the_points_pairs_written_out_in_name_order() -> None:
    assert point_key({"tp": 8, "sp": True, "cp_a2a_size": None, "zero": 2}) == (
        ("cp_a2a_size", "None"), ("sp", "True"), ("tp", "8"), ("zero", "2"))
    # True == 1 and 1 == 1.0, but they are written out apart
    assert point_key({"sp": True}) != point_key({"sp": 1}) != point_key({"sp": 1.0})
    assert point_key({"sp": 1})[0][1] == "1" and point_key({"sp": 1.0})[0][1] == "1.0"
    # an unhashable value is written out too
    assert point_key({"order": ["tp", "dp"]}) == (("order", "['tp', 'dp']"),)


def test_keys_share_their_pairs_and_the_memo_stays_bounded(monkeypatch) -> None:
    a = point_key({"tp": 4, "pp": 2})
    b = point_key({"pp": 2, "tp": 4, "vp": 1})
    assert a[0] is b[0] and a[1] is b[1]
    monkeypatch.setattr(keys, "PAIRS_LIMIT", 8)
    for v in range(100):
        assert point_key({"micro_batch": v}) == (("micro_batch", str(v)),)
        assert len(keys._PAIRS) <= 8
