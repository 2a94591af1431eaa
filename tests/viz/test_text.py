"""Tables as text and HTML, and byte counts: what every view of a plan lays out alike."""

from __future__ import annotations

import pytest

from fxckpt.viz.text import aligned, count_kinds, format_bytes, html_table, shorten


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                     (3 * 2**20, "3.0 MiB"), (2**50, "1024.0 TiB"),
                                     (-2048, "-2.0 KiB")])
def test_bytes_read_in_the_largest_unit_under_1024(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_columns_are_as_wide_as_their_widest_cell_and_lines_end_without_spaces() -> None:
    assert aligned(("a", "bb"), [("ccc", "d"), ("e", "")]) == ["a    bb", "ccc  d", "e"]


def test_kinds_are_counted_most_frequent_first_and_text_is_cut_with_dots() -> None:
    assert count_kinds(("gelu", "addmm", "addmm")) == "addmm x2, gelu"
    assert count_kinds(()) == "-"
    assert shorten("abcdefgh", 8) == "abcdefgh" and shorten("abcdefghi", 8) == "abcde..."


def test_html_tables_escape_cells_and_carry_hints() -> None:
    table = html_table(("a<b", "c"), [("<x>", "y")], {"c": 'say "hi"'})
    assert table == ('<table><thead><tr><th title="">a&lt;b</th><th title="say &quot;hi&quot;">'
                     'c</th></tr></thead><tbody><tr><td>&lt;x&gt;</td><td>y</td></tr></tbody>'
                     '</table>')
