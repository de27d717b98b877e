"""Field checks shared by the calibration and cost-table JSON readers: every error names the field,
the value and the fix."""

from __future__ import annotations

from pathlib import Path


def read_fields(data, spec: dict[str, tuple[type, bool, bool]], what: str) -> dict:
    """Check a decoded JSON object against spec {field: (element type, is_list, required)}.
    Raises ValueError naming the offending field; unknown fields are errors too."""
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a JSON object with fields {sorted(spec)}, got {type(data).__name__}")
    unknown = sorted(set(data) - set(spec))
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; the format has {sorted(spec)}")
    out = {}
    for name, (typ, is_list, required) in spec.items():
        if name not in data:
            if required:
                raise ValueError(f"{what}: missing field `{name}` (the format has {sorted(spec)})")
            continue
        value = data[name]
        items = value if is_list and isinstance(value, list) else [value]
        kind = {int: "integer", float: "number", str: "string"}[typ]
        ok_types = (int, float) if typ is float else (typ,)
        if (is_list and not isinstance(value, list)) or any(
                isinstance(v, bool) or not isinstance(v, ok_types) for v in items):
            raise ValueError(f"{what}: field `{name}` must be {'a list of ' + kind + 's' if is_list else 'a ' + kind}, "
                             f"got {value!r}")
        out[name] = tuple(typ(v) for v in value) if is_list else typ(value)
    return out


def in_file(path: str | Path, parse):
    """parse(text of `path`), with the path added to any format error."""
    try:
        return parse(Path(path).read_text(encoding="utf-8"))
    except ValueError as err:                    # json.JSONDecodeError included
        raise ValueError(f"{err} (file {path})") from None


def need(ok: bool, what: str, name: str, value, fix: str) -> None:
    """Raise ValueError `what: field `name` = value fix` unless `ok`."""
    if not ok:
        raise ValueError(f"{what}: field `{name}` = {value!r} {fix}")


def check_probes(what: str, name: str, probes: tuple, values_name: str, values: tuple) -> None:
    """`probes` non-empty and strictly increasing, with one entry of `values` per probe."""
    need(len(probes) > 0, what, name, probes, "must hold at least one probe")
    need(all(a < b for a, b in zip(probes, probes[1:])), what, name, probes,
          "must be strictly increasing: sort the probes and take the median of repeated ones")
    need(len(values) == len(probes), what, values_name, values, f"needs one value per entry of `{name}` "
          f"({len(probes)})")
