"""run_main: every way a step can end is one ``error:`` line first (issue 14, point 5)."""
from __future__ import annotations

import pytest

from steps.errors import EXIT_INPUT_ERROR, EXIT_UNEXPECTED, StepError, one_line, run_main


def _lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_step_error_is_one_escaped_line(capsys):
    def main(argv):
        raise StepError("file bad\nname\x1b[31m.nii.gz: truncated")

    assert run_main(main, []) == EXIT_INPUT_ERROR
    lines = _lines(capsys)
    assert lines == ["error: file bad\\nname\\x1b[31m.nii.gz: truncated"]


def test_unexpected_exception_names_the_step_then_the_traceback(capsys):
    def main(argv):
        raise KeyError("no such key\nsecond line")

    assert run_main(main, []) == EXIT_UNEXPECTED
    lines = _lines(capsys)
    assert lines[0].startswith(f"error: {__name__}: unexpected KeyError: ")
    assert "\\n" in lines[0] and sum(line.startswith("error:") for line in lines) == 1
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1].startswith("KeyError")


def test_memory_error_is_reported_as_out_of_memory(capsys):
    def main(argv):
        raise MemoryError()

    assert run_main(main, []) == EXIT_UNEXPECTED
    assert _lines(capsys)[0] == (f"error: {__name__}: out of memory (MemoryError); give the "
                                 "step more memory or smaller inputs")


@pytest.mark.parametrize("text, expected", [
    ("plain", "plain"), ("tab\there", "tab\\there"), ("bell\x07", "bell\\x07"),
    ("c1\x9b", "c1\\x9b"), ("sep\u2028x", "sep\\u2028x"), ("  padded\n", "padded"),
])
def test_one_line_escapes_control_characters(text, expected):
    assert one_line(text) == expected
    assert one_line(one_line(text)) == one_line(text)


def test_the_error_line_becomes_the_pods_termination_message(tmp_path, monkeypatch, capsys):
    """Where the kubelet mounted a termination-message file, the error line replaces what it
    held (Argo shows it as the node's message); where none is, nothing is created; a link
    there is not followed."""
    def main(argv):
        raise StepError("train: --fold 4 is out of range for 4 folds (0-3)")

    message = tmp_path / "termination-log"
    message.write_text("an earlier, longer message that must not survive")
    monkeypatch.setenv("UNET_TERMINATION_LOG", str(message))
    assert run_main(main, []) == EXIT_INPUT_ERROR
    assert message.read_text() == "error: train: --fold 4 is out of range for 4 folds (0-3)"
    assert _lines(capsys) == [message.read_text()]

    absent = tmp_path / "absent"
    monkeypatch.setenv("UNET_TERMINATION_LOG", str(absent))
    run_main(main, [])
    assert not absent.exists()

    target = tmp_path / "host-file"
    target.write_text("host")
    (tmp_path / "link").symlink_to(target)
    monkeypatch.setenv("UNET_TERMINATION_LOG", str(tmp_path / "link"))
    run_main(main, [])
    assert target.read_text() == "host"
