"""`errors.first_line`: how every one-line error quotes a failure from elsewhere (its message's first line)."""
from __future__ import annotations

from normswap.errors import first_line


def test_the_first_line_of_a_message():
    assert first_line(ValueError("bad value\nat line 3\n")) == "bad value"
    assert first_line("plain text\nmore") == "plain text"


def test_no_message_gives_the_default():
    assert first_line(ValueError()) == ""   # once an IndexError at some sites
    assert first_line(KeyError(), "KeyError") == "KeyError"


def test_strip_skips_leading_blank_lines():
    e = RuntimeError("\n  compiler said no  \nlog")
    assert first_line(e) == ""                       # as `str(e).splitlines()[0]` gave
    assert first_line(e, strip=True) == "compiler said no  "   # the message is stripped, not the line
    assert first_line(RuntimeError(" \n "), "RuntimeError", strip=True) == "RuntimeError"
    assert first_line(RuntimeError(" \n ")) == " "    # unstripped: a blank first line, not the default


def test_a_first_line_that_introduces_the_next_takes_it_along():
    """Issue 33 #20: LLaVA with a bogus vision_feature_select_strategy was refused with the reason cut off after
    "Validation error for field 'vision_feature_select_strategy':"."""
    e = TypeError("Validation error for field 'mode':\n    TypeError: Field 'mode' expected one of ('a', 'b'), got c\n")
    assert first_line(e) == "Validation error for field 'mode': TypeError: Field 'mode' expected one of ('a', 'b'), " \
                            "got c"
    assert first_line("a:\n\n b:\n c\n d") == "a: b: c"
    assert first_line("ends in a colon:") == "ends in a colon:"
