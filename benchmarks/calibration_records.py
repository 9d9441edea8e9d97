"""Where benchmarks/calibrate.py --write puts a fit: every GPU record of the fitted family
(hardware/data/gpus/<preset>.yaml, efficiencies.default), each fitted value with its source
(``microbenchmark fit: <file>, rows of <GPUs>``, ``end-to-end fit: <tables>``, ``derived: ...``),
what the fit does not pin keeping its value and source; a software profile's own attention set
(efficiencies.<profile>) replaced whole. A run writes all its records or none. Not a benchmark of
its own: calibrate.py's writer."""

from __future__ import annotations

from pathlib import Path

from stage_cosim.hardware.gpu import parse_record, record_header, render_record

RECORDS = Path(__file__).resolve().parents[1] / "hardware" / "data" / "gpus"

# What a software profile's own attention kernel keeps (efficiencies.<profile> in the records):
# parameter -> (value, source), per profile.
ProfileSets = dict[str, dict[str, tuple[float, str]]]


def _stored(value: float) -> float:
    """A fitted value as a record holds it: four significant digits (what the fit determines)."""
    return float(f"{value:.4g}")


def write_records(fitted: dict[str, tuple[dict[str, float], dict[str, str], ProfileSets]],
                  directory: Path = RECORDS) -> list[Path]:
    """Store each family's fitted values (family -> (values, sources, the software profiles'
    own sets)) in every GPU record of the family in ``directory``, each value with its source
    (a profile's set replaced whole); the records' other parameters, fields and header comments
    stay as they are. All the records are written, or none."""
    texts: dict[Path, str] = {}
    seen = set()
    for path in sorted(directory.glob("*.yaml")):
        text = path.read_text()
        rec = parse_record(text, str(path))
        if rec["calibration_family"] not in fitted:
            continue
        seen.add(rec["calibration_family"])
        values, sources, profiles = fitted[rec["calibration_family"]]
        for k, v in values.items():
            rec["efficiencies"]["default"][k] = {"value": _stored(v), "source": sources[k]}
        sets = {"default": rec["efficiencies"]["default"]}
        sets |= {name: {k: {"value": _stored(x), "source": src} for k, (x, src) in own.items()}
                 for name, own in profiles.items()}
        rec["efficiencies"] = sets
        texts[path] = render_record(rec, record_header(text))
    missing = set(fitted) - seen
    if missing:
        raise SystemExit(f"no GPU record in {directory} of the families {sorted(missing)}")
    tmps = []
    for path, text in texts.items():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmps.append((tmp, path))
    for tmp, path in tmps:
        tmp.replace(path)          # (every record written before any replaces its file)
    return list(texts)
