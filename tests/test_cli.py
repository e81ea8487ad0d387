"""Output files of the command-line scripts: replaced whole, never mixed, devices and pipes written."""

import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from vanilla_transformer.cli import check_output_file, replaced_when_complete


def test_two_writers_of_one_path_leave_one_whole_file(tmp_path):
    path = tmp_path / "out.txt"
    with replaced_when_complete(path) as first:
        first.write("first 1\n")
        with replaced_when_complete(path) as second:
            second.write("second 1\nsecond 2\n")
        assert path.read_text() == "second 1\nsecond 2\n"
        first.write("first 2\n")
    assert path.read_text() == "first 1\nfirst 2\n"  # whichever finished last, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file_and_its_mode(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old\n")
    path.chmod(0o640)
    with pytest.raises(RuntimeError), replaced_when_complete(path) as stream:
        stream.write("half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "old\n" and sorted(tmp_path.iterdir()) == [path]
    with replaced_when_complete(path) as stream:
        stream.write("new\n")
    assert path.read_text() == "new\n" and stat.S_IMODE(path.stat().st_mode) == 0o640
    umask = os.umask(0o027)
    try:
        with replaced_when_complete(tmp_path / "fresh.txt") as stream:
            stream.write("x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "fresh.txt").stat().st_mode) == 0o640  # 0666 less the umask


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_named_pipe_is_written_not_replaced(tmp_path):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    received = []
    reader = threading.Thread(target=lambda: received.append(pipe.read_text()), daemon=True)
    reader.start()
    assert check_output_file(pipe) == pipe
    with replaced_when_complete(pipe) as stream:
        stream.write("Am Anfang.\n")
    reader.join(timeout=30)
    assert received == ["Am Anfang.\n"]
    assert stat.S_ISFIFO(os.stat(pipe).st_mode) and sorted(tmp_path.iterdir()) == [pipe]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="/proc names of open files")
def test_the_pipe_an_input_reads_is_refused_as_output():
    """`echo text | translate.py --output /dev/stdin` held a write end of its own input pipe open and
    waited for that pipe's end forever."""
    read_end, write_end = os.pipe()
    try:
        with os.fdopen(read_end, "rb", closefd=False) as reading:
            with pytest.raises(ValueError, match=r"is the pipe an input reads"):
                check_output_file(f"/proc/self/fd/{read_end}", reading)
            assert check_output_file(f"/proc/self/fd/{write_end}") == Path(f"/proc/self/fd/{write_end}")
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_device_is_written_not_replaced(tmp_path):
    # Through a link in tmp_path: were the device replaced, the link would be, not /dev/null itself.
    device = tmp_path / "null"
    device.symlink_to(os.devnull)
    with replaced_when_complete(device) as stream:
        stream.write("nothing\n")
    assert device.is_symlink() and stat.S_ISCHR(os.stat(device).st_mode)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux's /proc")
def test_a_path_under_proc_or_dev_is_written_through_not_replaced(tmp_path):
    """/dev/stdout is a link to whatever standard output is, a regular file too: it was replaced by a
    file of its own (as root). The same through /proc/self/fd, whose entries cannot be replaced."""
    target = tmp_path / "target.txt"
    target.write_text("")
    with target.open("r+") as held, replaced_when_complete(f"/proc/self/fd/{held.fileno()}") as stream:
        stream.write("through the link\n")
    assert target.read_text() == "through the link\n"


def test_a_windows_folder_named_dev_is_no_device(monkeypatch):
    """`C:\\dev\\project\\es.txt` counted as a device path (its first folder "dev"): written in place, an
    interrupted run left half a file. /dev and /proc are POSIX's."""
    from vanilla_transformer import cli

    assert cli._written_through(Path("/dev/null"))
    output = Path("/dev/project/es.txt")  # made before: pathlib would make a WindowsPath
    monkeypatch.setattr(cli.os, "name", "nt")
    assert not cli._written_through(output)


def test_json_field_reads_utf_8_whatever_the_locale(tmp_path):
    """tokenizer.json, written in UTF-8 with "\u2581" in every word piece, read in the locale's encoding
    (cp1252 on Windows, ASCII here) failed to decode and counted as missing: the check that refuses a
    checkpoint of another vocabulary was skipped without a word."""
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"\u2581the": 5}}}', encoding="utf-8")
    code = "import sys; from pathlib import Path; from vanilla_transformer.cli import json_field; "
    code += "print(json_field(Path(sys.argv[1]), 'model')['vocab']['\\u2581the'])"
    environment = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "tokenizer.json")],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.split()[-1] == "5", result.stderr[-2000:]


def test_an_output_in_a_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    """evaluate_model.py --hypotheses in a read-only folder translated everything, then failed: the file
    is written beside its name and renamed, so its folder must be writable. A device or a pipe, written
    directly, needs no writable folder."""
    access = os.access

    def read_only(path, mode, *args, **kwargs):  # as for a read-only mount (a folder's mode binds no root)
        return not (mode & os.W_OK and Path(path) == tmp_path) and access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", read_only)
    for output in (tmp_path / "new.txt", tmp_path / "existing.txt"):
        output.with_name("existing.txt").write_text("old\n")
        with pytest.raises(ValueError, match=f"^{output}: the folder {tmp_path} is not writable"):
            check_output_file(output)
    device = tmp_path / "null"
    device.symlink_to(os.devnull)
    assert check_output_file(device) == device
    assert check_output_file(tmp_path.parent / "fine.txt") == tmp_path.parent / "fine.txt"


def test_evaluate_model_script_refuses_a_bleu_tokeniser_before_loading_anything(tmp_path):
    """--bleu_tokenize reaches the scoring: a name sacreBLEU lacks is refused before the model and the
    data are read (here neither exists)."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "evaluate_model.py"
    result = subprocess.run(
        [sys.executable, str(script), "--model", str(tmp_path / "none"), "--bleu_tokenize", "chars"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "error: unknown BLEU tokeniser 'chars'; sacreBLEU's are none, zh, 13a" in result.stderr


def test_the_scripts_modules_import_evaluate_datasets_and_matplotlib_only_when_used():
    """Each of them added half a second to a second to every script's start (`--help`, a refused flag),
    imported at the top of modules that every script loads. (`finetune.py` loads transformers' Trainer,
    which imports `datasets` itself.)"""
    import subprocess
    import sys

    modules = ["training", "evaluation", "translation", "metrics", "parallel_data", "plotting"]
    code = (
        "import sys\n"
        + "".join(f"import vanilla_transformer.{module}\n" for module in modules)
        + "print(sorted({'evaluate', 'datasets', 'matplotlib'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["[]"]


def hangup_writer(path: Path, disposition: signal.Handlers) -> subprocess.Popen:
    """A process writing `path` through `replaced_when_complete`, started with SIGHUP's action set to
    `disposition` (as a terminal session leaves it, or as `nohup` does, whatever the test runner's own
    is: ignored signals are inherited), that finishes the file when a line comes on its standard input."""
    code = (
        "import sys\n"
        "from vanilla_transformer.cli import replaced_when_complete\n"
        f"with replaced_when_complete({str(path)!r}) as stream:\n"
        "    stream.write('half\\n'); stream.flush(); print('ready', flush=True); sys.stdin.readline()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, disposition),
    )


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP")
def test_a_writer_ended_by_sighup_keeps_the_old_file_and_leaves_no_partial_file(tmp_path):
    """SIGHUP (the terminal of a long translate.py run closed, an ssh session dropped) ended the process
    at once: the old file stayed, but the hidden `.NAME.PID.HEX.partial` beside it was left for good,
    as large as the work done. It ends the process as SIGTERM does (tests/test_training.py), through the
    writer's cleanup."""
    path = tmp_path / "out.txt"
    path.write_text("old\n")
    process = hangup_writer(path, signal.SIG_DFL)
    try:
        assert process.stdout.readline() == "ready\n"
        assert len(list(tmp_path.glob(".out.txt.*.partial"))) == 1
        process.send_signal(signal.SIGHUP)
        assert process.wait(timeout=30) == 128 + signal.SIGHUP
    finally:
        process.kill()
    assert path.read_text() == "old\n" and sorted(tmp_path.iterdir()) == [path]


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP")
def test_a_writer_under_nohup_outlives_sighup_and_finishes_its_file(tmp_path):
    """Under `nohup` (SIGHUP ignored) a hangup must not end the writer: its work is what nohup keeps."""
    path = tmp_path / "out.txt"
    path.write_text("old\n")
    process = hangup_writer(path, signal.SIG_IGN)
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1)
        process.stdin.write("go on\n")
        process.stdin.flush()
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
    assert path.read_text() == "half\n" and sorted(tmp_path.iterdir()) == [path]


def test_translate_with_standard_input_closed_names_the_flag(run_in_process, tmp_path):
    """A closed standard input (a shell's `<&-`) was an AttributeError traceback from inside argparse; it
    is now --input's error, before any model is loaded. A file given as --input still reads."""
    closed = run_in_process("translate.py", "--model", str(tmp_path / "none"), stdin=None)
    assert closed.returncode == 2 and "Traceback" not in closed.stderr
    assert "argument --input: standard input is closed; name a file to read (--input FILE)" in closed.stderr
    (tmp_path / "in.txt").write_text("Jesus wept.\n")
    given = run_in_process(
        "translate.py", "--model", str(tmp_path / "none"), "--input", str(tmp_path / "in.txt")
    )
    assert given.returncode == 2 and "No model folder" in given.stderr  # past the input, to the model


def test_numbers_past_what_the_libraries_take_are_the_flags_errors(run_in_process, tmp_path):
    """translate.py's --max_new_tokens of 2**64 was a TypeError from torch, and --num_beams of 2**63 a
    TypeError listing CTranslate2's signature: each is now refused with the flag's name, before any model
    is loaded. (A length penalty too large for transformers' beam search is generate()'s error.)"""
    (tmp_path / "in.txt").write_text("Jesus wept.\n")
    common = ["--model", str(tmp_path / "none"), "--input", str(tmp_path / "in.txt")]
    for flags, message in (
        (["--length_penalty", "inf"], "--length_penalty must be a finite number, got inf"),
        (["--max_new_tokens", str(2**64)], f"argument --max_new_tokens: must be at most {2**63 - 1}"),
        (["--num_beams", str(2**63)], "argument --num_beams: must be at most"),
        (["--no_repeat_ngram_size", str(2**63)], "argument --no_repeat_ngram_size: must be at most"),
    ):
        result = run_in_process("translate.py", *common, *flags)
        assert result.returncode == 2 and "Traceback" not in result.stderr, flags
        assert message in result.stderr, (flags, result.stderr[-500:])
    at_the_bound = run_in_process("translate.py", *common, "--max_new_tokens", str(2**63 - 1))
    assert at_the_bound.returncode == 2 and "No model folder" in at_the_bound.stderr  # to the model
