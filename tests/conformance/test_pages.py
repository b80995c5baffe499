"""The suite's page comparison: equal pages pass, and a difference is named in one short line
(offset, lengths, a few bytes), however large the pages, where pytest's own explanation of a
failed ``==`` diffs the reprs (minutes for MiB pages with CI set)."""

import pytest

from hicache_storage.conformance.pages import assert_same_bytes, byte_difference

MIB = 1 << 20


def test_equal_pages_and_lists_have_no_difference():
    page = bytes(range(256)) * 4096
    assert byte_difference(page, bytearray(page)) is None
    assert byte_difference([memoryview(page), None], [page, None]) is None
    assert_same_bytes([page], [page])


@pytest.mark.parametrize(
    "got, expected, line",
    [
        (b"abc", b"abd", "3 bytes against 3, first different at byte 2: got 63, expected 64"),
        (b"ab", b"abc", "got 2 bytes, expected 3 (equal over the first 2)"),
        (None, b"a", "got a miss, expected 1 byte"),
        (b"ab", None, "got 2 bytes, expected a miss"),
        ([b"a", None], [b"a", b"bc"], "page 1 of 2: got a miss, expected 2 bytes"),
        ([b"a"], [b"a", b"b"], "got 1 pages, expected 2"),
        (b"a", [b"a"], "got 1 byte where a list of 1 pages was expected"),
    ],
)
def test_a_difference_is_named(got, expected, line):
    assert byte_difference(got, expected) == line


def test_a_mib_page_differing_late_is_located_in_one_short_line():
    expected = bytes(20 * MIB)
    got = bytearray(expected)
    got[20 * MIB - 5] = 0xFF
    with pytest.raises(AssertionError) as raised:
        assert_same_bytes(got, expected, "the 20 MiB page")
    message = str(raised.value)
    assert message == f"the 20 MiB page: {20 * MIB} bytes against {20 * MIB}, first different at byte {20 * MIB - 5}: got ff00000000, expected 0000000000"
