"""Click options generated from the workflows' options dataclasses (as mergekit generates its click options
from its options model); the options object built back from what click parsed; and the flag names errors show
(`NormswapError.for_cli`). All come from the fields' metadata: nothing is kept by hand beside the dataclasses.

Metadata keys: flag (the option), secondary (its off switch: --no-...), help, metavar, show_default, required,
is_flag, choices, type (int, float or "path"), min, max, min_open, max_open, multiple (a tuple field),
default (on the command line, where it differs from the field's), also ({value: (flag, help)}: a switch
setting the field to value), parse (the CLI value -> the field's), error (how errors spell the field, where
not as its flag), aliases ({other Python name: CLI spelling} for errors), prefix (on a nested options field:
how errors prefix its fields, `lora.rank`). A field without `flag` (show_progress) is not on the command line.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import click

POSITIONAL = {"src": "SRC", "out": "OUT"}   # the workflows' positional parameters, as the commands name them


def _fields(cls, skip=(), path="", prefix="") -> Iterator[tuple[str, str, dataclasses.Field]]:
    """(dotted path, name in errors, field) of every field of `cls` a flag sets, nested options included."""
    for f in dataclasses.fields(cls):
        if path + f.name in skip:
            continue
        if dataclasses.is_dataclass(f.default):
            yield from _fields(type(f.default), skip, f"{path}{f.name}.", prefix + f.metadata.get("prefix", ""))
        elif "flag" in f.metadata:
            yield path + f.name, prefix + f.name, f


def _param(path: str, value=None) -> str:
    """The click parameter a field (or its `also` switch for `value`) arrives as."""
    return path.replace(".", "__") + ("" if value is None else f"__{value}")


def _switch(f: dataclasses.Field) -> bool:
    m = f.metadata
    return "secondary" in m or m.get("is_flag", False) or isinstance(f.default, bool)


def _type(m):
    if "choices" in m:
        return click.Choice(list(m["choices"]))
    if m.get("type") == "path":
        return click.Path()
    bounds = {k: m[k] for k in ("min", "max", "min_open", "max_open") if k in m}
    if bounds:
        return (click.IntRange if m["type"] is int else click.FloatRange)(**bounds)
    return m.get("type")


def click_options(cls, skip=()) -> list:
    """The click options that set the fields of `cls` (but those whose dotted path is in `skip`)."""
    options = []
    for path, _, f in _fields(cls, skip):
        m = f.metadata
        kw = {k: m[k] for k in ("help", "metavar", "show_default", "multiple") if k in m}
        decls = [m["flag"] + (f"/{m['secondary']}" if "secondary" in m else ""), _param(path)]
        if m.get("required"):
            kw["required"] = True
        else:
            kw["default"] = m.get("default", f.default)
        if "secondary" not in m and _switch(f):
            kw["is_flag"] = True
        elif not _switch(f) and _type(m) is not None:
            kw["type"] = _type(m)
        options.append(click.option(*decls, **kw))
        options += [click.option(flag, _param(path, value), is_flag=True, help=text)
                    for value, (flag, text) in m.get("also", {}).items()]
    return options


def build(cls, kw: dict, skip=(), path="", **given):
    """A `cls` from the click values in `kw` (those it uses are popped), with the fields in `given`."""
    values = {}
    for f in dataclasses.fields(cls):
        if path + f.name in skip or f.name in given:
            continue
        m = f.metadata
        if dataclasses.is_dataclass(f.default):
            values[f.name] = build(type(f.default), kw, skip, f"{path}{f.name}.")
        elif "flag" in m:
            value = kw.pop(_param(path + f.name))
            for also in m.get("also", {}):
                value = also if kw.pop(_param(path + f.name, also)) else value
            values[f.name] = m["parse"](value) if "parse" in m else value
    return cls(**values, **given)


def error_names(*classes) -> dict[str, str]:
    """Python spelling -> CLI spelling of every option errors may name (`overwrite=True` -> --overwrite,
    `method='naive'` -> --method naive, `lr` -> --lr), for the options of `classes`."""
    names = dict(POSITIONAL)
    for cls in classes:
        for _, name, f in _fields(cls):
            m = f.metadata
            if _switch(f):
                names[f"{name}=True"] = m["flag"]
            else:
                names[name] = m.get("error", m["flag"])
            names.update({f"{name}={c!r}": f"{m['flag']} {c}" for c in m.get("choices", ())})
            for value, (flag, _) in m.get("also", {}).items():
                names.setdefault(f"{name}={value!r}", flag)
            names.update(m.get("aliases", {}))
    return names
