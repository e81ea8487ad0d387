"""The final model folder is replaced all at once: a kill at any step leaves the old folder or the new one."""

import errno
import os
from pathlib import Path

import pytest

from vanilla_transformer import publishing
from vanilla_transformer.publishing import (
    check_new_folder,
    check_renamable,
    check_writable_place,
    finish_interrupted_publish,
    publish_folder,
    staging_paths,
)
from vanilla_transformer.training import TrainingConfig

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

OLD = {"config.json": "old config", "model.safetensors": "old weights", "README.md": "old card"}
NEW = {"config.json": "new config", "model.safetensors": "new weights", "README.md": "new card"}
KEPT = {"checkpoints/step-1/state.json": "1", "logs/events": "log", "notes.txt": "mine"}


def write_files(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def read_files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


def test_publishing_a_new_folder(tmp_path):
    with publish_folder(tmp_path / "model") as staging:
        assert staging.parent == tmp_path and not (tmp_path / "model").exists()
        write_files(staging, NEW)
    assert read_files(tmp_path / "model") == NEW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_publishing_replaces_the_model_files_and_keeps_everything_else(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    write_files(folder, OLD | KEPT)
    with publish_folder(folder) as staging:
        write_files(staging, NEW)
    assert read_files(folder) == NEW | KEPT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_publishing_without_keeping_other_files_replaces_the_whole_folder(tmp_path):
    """What an export does: an earlier export's files that the new one does not write would be read
    with it (another tokenizer's, another vocabulary layout's)."""
    folder = tmp_path / "model"
    folder.mkdir()
    write_files(folder, OLD | KEPT)
    with publish_folder(folder, keep_other_files=False) as staging:
        assert not any(staging.iterdir())
        write_files(staging, NEW)
    assert read_files(folder) == NEW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_an_error_while_writing_leaves_the_old_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    write_files(folder, OLD | KEPT)
    with pytest.raises(OSError, match="disk full"), publish_folder(folder) as staging:
        write_files(staging, {"config.json": "new config"})
        raise OSError("disk full")
    assert read_files(folder) == OLD | KEPT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_the_current_folder_or_one_holding_it_is_refused(tmp_path, monkeypatch):
    """Published, it was renamed away from under the process and the shell that started it (an empty
    name, an unset shell variable, is the current folder)."""
    inner = tmp_path / "outer" / "inner"
    inner.mkdir(parents=True)
    monkeypatch.chdir(inner)
    for name in ("", ".", "..", str(tmp_path / "outer")):
        with pytest.raises(ValueError, match=r"is the current folder or holds it; .* name a subfolder"):
            check_new_folder(name)
    check_new_folder("sub")
    check_new_folder(tmp_path / "elsewhere")


def test_a_linked_folder_is_published_into_its_target(tmp_path):
    """A symbolic link used to be replaced by a real folder, its target emptied (same file system) or
    the publication stopped half way (another one: a rename cannot cross), blocking every later run."""
    target, link = tmp_path / "disk" / "model", tmp_path / "model"
    target.mkdir(parents=True)
    write_files(target, OLD | KEPT)
    link.symlink_to(target)
    for _ in range(2):  # and again, as a later run would
        with publish_folder(link) as staging:
            assert staging.parent == target.parent
            write_files(staging, NEW)
        assert link.is_symlink() and read_files(target) == NEW | KEPT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "model"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]


def test_a_folder_named_with_dot_dot_is_published_beside_itself(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    (folder / "inner").mkdir(parents=True)
    write_files(folder, OLD)
    monkeypatch.chdir(folder / "inner")
    with publish_folder("..") as staging:
        assert staging.parent == tmp_path
        write_files(staging, NEW)
    assert read_files(folder) == NEW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


class Killed(BaseException):
    """Stands for the process dying: nothing after it runs, not even `except Exception` blocks."""


def count_file_operations(tmp_path: Path, keep_other_files: bool) -> int:
    calls = []
    real = os.replace
    folder = tmp_path / "count"
    folder.mkdir()
    write_files(folder, OLD | KEPT)
    publishing.os.replace = lambda *args: (calls.append(args), real(*args))
    try:
        with publish_folder(folder, keep_other_files=keep_other_files) as staging:
            write_files(staging, NEW)
    finally:
        publishing.os.replace = real
    return len(calls)


@pytest.mark.parametrize("keep_other_files", [True, False])
def test_a_kill_at_any_rename_leaves_a_folder_that_recovery_completes(
    tmp_path, monkeypatch, keep_other_files
):
    """Kill the publication before each of its renames (and before deleting the old folder); the
    folder on disk is then the old one or the new one, and recovery leaves the new one with every
    kept file (none without `keep_other_files`)."""
    renames = count_file_operations(tmp_path, keep_other_files)
    kept = KEPT if keep_other_files else {}
    # partial -> ready, each kept entry, old folder -> replaced, ready -> folder
    assert renames == 3 + len({Path(name).parts[0] for name in kept})
    real_replace, real_rmtree = os.replace, publishing.shutil.rmtree
    for kill_at in range(renames + 1):
        folder = tmp_path / f"model-{kill_at}"
        folder.mkdir()
        write_files(folder, OLD | KEPT)
        calls = []

        def replace(src, dst, kill_at=kill_at, calls=calls):
            if len(calls) == kill_at:
                raise Killed
            calls.append(src)
            real_replace(src, dst)

        def rmtree(path, *args, kill_at=kill_at, calls=calls, **kwargs):
            if Path(path).name.endswith(".replaced") and kill_at == renames:
                raise Killed
            real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(publishing.os, "replace", replace)
        monkeypatch.setattr(publishing.shutil, "rmtree", rmtree)
        with pytest.raises(Killed), publish_folder(folder, keep_other_files=keep_other_files) as staging:
            write_files(staging, NEW)
        monkeypatch.setattr(publishing.os, "replace", real_replace)
        monkeypatch.setattr(publishing.shutil, "rmtree", real_rmtree)

        # What a reader sees right after the kill: a whole old or a whole new model.
        if folder.exists():
            model = {k: v for k, v in read_files(folder).items() if k in NEW}
            assert model in (OLD, NEW), kill_at
        else:  # between the two renames of the swap: the new folder is complete beside it
            ready = read_files(staging_paths(folder)[1])
            assert {k: v for k, v in ready.items() if not k.startswith(".")} == NEW | kept
        finish_interrupted_publish(folder)
        expected = OLD | KEPT if kill_at == 0 else NEW | kept
        assert read_files(folder) == expected, kill_at
        assert not any(p.exists() for p in staging_paths(folder)), kill_at


def test_a_killed_write_is_discarded(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    write_files(folder, OLD | KEPT)
    partial = staging_paths(folder)[0]
    partial.mkdir()
    write_files(partial, {"config.json": "half written"})
    finish_interrupted_publish(folder)
    assert read_files(folder) == OLD | KEPT
    assert not partial.exists()


def test_states_no_single_kill_leaves_are_brought_back_without_loss(tmp_path):
    """Two states that only overlapping runs or hands leave: an old folder set aside (`.replaced`) with no
    folder in its place is put back, not deleted; a stale `.replaced` beside a folder and a complete new one
    is removed and the new one published, keeping the folder's other files."""
    folder = tmp_path / "model"
    _, ready, replaced = staging_paths(folder.resolve())
    replaced.mkdir()
    write_files(replaced, OLD | KEPT)
    finish_interrupted_publish(folder)
    assert read_files(folder) == OLD | KEPT and not replaced.exists()

    replaced.mkdir()
    write_files(replaced, {"config.json": "stale"})
    ready.mkdir()
    write_files(ready, NEW)
    finish_interrupted_publish(folder)
    assert read_files(folder) == NEW | KEPT
    assert not any(p.exists() for p in staging_paths(folder.resolve()))


def test_a_mount_point_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A volume mounted at the folder (Docker, Kubernetes) cannot be replaced by a rename: the finished
    model once stayed in the hidden sibling, on the parent's file system, and every later run failed."""
    volume = tmp_path / "volume"
    volume.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == volume or real_ismount(path))
    with (
        pytest.raises(ValueError, match=r"is a mount point .* such as .*volume/model"),
        publish_folder(volume),
    ):
        raise AssertionError("not reached")
    assert not any(path.name.startswith(".") for path in tmp_path.iterdir())
    check_renamable(volume / "model")  # a folder inside the volume is fine
    with pytest.raises(ValueError, match="is a mount point"):
        TrainingConfig(output_dir=str(volume), report_to="none")  # refused before training


def test_mount_points_are_read_from_mountinfo_bind_mounts_included(tmp_path, monkeypatch):
    """A bind mount of a folder of the same file system: `os.path.ismount` does not see it, and a rename
    onto it fails all the same (EBUSY)."""
    volume = tmp_path / "my volume"
    volume.mkdir()
    escaped = str(volume).replace(" ", "\\040")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"36 35 98:0 /data {escaped} rw,noatime shared:1 - ext4 /dev/sda1 rw\n")
    assert publishing.mount_points(mountinfo) == {volume}
    assert publishing.mount_points(tmp_path / "absent") == set()
    monkeypatch.setattr(publishing, "mount_points", lambda: {volume})
    with pytest.raises(ValueError, match="is a mount point"):
        check_renamable(volume)


def read_only(monkeypatch, *folders: Path) -> None:
    """Make `os.access` answer that `folders` cannot be written, as it does for a read-only mount or
    another user's folder (the tests may run as root, for whom a folder's mode changes nothing)."""
    access = os.access

    def patched(path, mode, *args, **kwargs):
        if mode & os.W_OK and Path(path) in folders:
            return False
        return access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", patched)


def test_a_place_that_cannot_be_written_is_named_before_any_work(tmp_path, monkeypatch):
    """A folder under a file, or in a read-only place, failed only when it was written (train.py's
    lock, average_checkpoints.py's publish), with a traceback."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for folder in (afile / "model", afile / "sub" / "model"):
        with pytest.raises(
            ValueError, match=rf"^{folder} cannot be written: {afile} is a file, not a folder\.$"
        ):
            check_writable_place(folder)
    assert afile.read_text() == "mine"
    check_writable_place(tmp_path / "new" / "model")  # missing parents are made
    (tmp_path / "model").mkdir()
    check_writable_place(tmp_path / "model")
    read_only(monkeypatch, tmp_path)
    for folder in (tmp_path / "model", tmp_path / "new" / "model"):
        with pytest.raises(ValueError, match=rf"^{folder} cannot be written: {tmp_path} is not writable"):
            check_writable_place(folder)
    monkeypatch.undo()
    read_only(monkeypatch, tmp_path / "model")  # its files are moved out when it is replaced
    with pytest.raises(ValueError, match=rf"{tmp_path / 'model'} is not writable"):
        check_writable_place(tmp_path / "model")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an open file by /proc/self/fd")
def test_a_folder_is_flushed_to_disk_before_it_is_published(tmp_path, monkeypatch):
    """The rename that publishes a folder reached the disk perhaps before its files did: after a crash
    of the machine, a complete-looking folder could hold empty files."""
    flushed, fsync = [], os.fsync

    def recorded_fsync(descriptor: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{descriptor}"))
        flushed.append((path, (tmp_path / "model").exists()))
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    with publishing.publish_folder(tmp_path / "model") as staging:
        write_files(staging, {"config.json": "{}", "sub/weights.bin": "w"})
    partial = publishing.staging_paths(tmp_path.resolve() / "model")[0]
    before = {path for path, published in flushed if not published}
    assert {partial / "config.json", partial / "sub" / "weights.bin", partial / "sub", partial} <= before
    assert flushed[-1] == (tmp_path.resolve(), True)  # then the renames into the parent folder


@pytest.mark.skipif(fcntl is None, reason="reads a descriptor's access mode with fcntl")
def test_a_folder_is_flushed_through_writable_descriptors_on_windows(tmp_path, monkeypatch):
    """Windows' os.fsync (`_commit`: FlushFileBuffers) refuses a file opened for reading alone ("[Errno 9]
    Bad file descriptor"), which POSIX accepts: every checkpoint and model folder failed there. Here
    Windows is played by `os.name` and an fsync that refuses such descriptors as `_commit` does."""
    write_files(tmp_path / "model", {"config.json": "{}", "sub/weights.bin": "w"})
    flushed, fsync = [], os.fsync

    def windows_fsync(descriptor: int) -> None:
        if fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        flushed.append(os.fstat(descriptor).st_size)
        fsync(descriptor)

    failed = None
    with monkeypatch.context() as windows:  # undone before pytest, which makes paths, reports
        windows.setattr(os, "fsync", windows_fsync)
        windows.setattr(os, "name", "nt")
        try:
            publishing.sync_tree(tmp_path / "model")
        except OSError as error:
            failed = error
    assert failed is None  # once: OSError [Errno 9] Bad file descriptor
    assert sorted(flushed) == [1, 2]  # the two files written; folders cannot be opened there


def test_a_json_file_that_cannot_be_read_is_named(tmp_path):
    """An unreadable file (here a folder by that name; permissions alike) is named, not a traceback."""
    from vanilla_transformer.publishing import read_json_object

    (tmp_path / "generation_config.json").mkdir()
    with pytest.raises(ValueError, match=r"generation_config.json cannot be read: Is a directory"):
        read_json_object(tmp_path / "generation_config.json")


def test_a_file_mounted_on_its_own_is_refused_as_an_output_before_any_work(tmp_path, monkeypatch):
    """`docker run -v out.txt:/out.txt`: the output, written beside it and renamed, failed with EBUSY
    only once every line was translated."""
    from vanilla_transformer.cli import check_output_file

    mounted = tmp_path / "out.txt"
    mounted.write_text("kept\n")
    monkeypatch.setattr(publishing, "mount_points", lambda: {mounted})
    with pytest.raises(ValueError, match=r"out\.txt is a mount point .*name a file in a mounted folder"):
        check_output_file(mounted)
    assert check_output_file(tmp_path / "other.txt") == tmp_path / "other.txt"
    link = tmp_path / "link.txt"  # a link to the mounted file: the link is what is replaced
    link.symlink_to(mounted)
    assert check_output_file(link) == link
    monkeypatch.setattr(publishing, "mount_points", lambda: {tmp_path})  # a mounted folder: fine
    assert check_output_file(mounted) == mounted


def test_a_dangling_link_as_a_runs_folder_is_refused(tmp_path):
    """An --output_dir of train.py or finetune.py that is a link to a folder not yet made failed in the
    first folder made inside it (a traceback from the tokenizer's save, or "File exists"). A folder
    written beside its name and renamed (an export, an average) goes through such a link."""
    from vanilla_transformer.finetuning import FinetuneConfig
    from vanilla_transformer.publishing import check_not_dangling_link

    link = tmp_path / "run"
    link.symlink_to(tmp_path / "elsewhere" / "run")
    with pytest.raises(ValueError, match=r"run is a symbolic link to .*elsewhere/run, which does not exist"):
        check_not_dangling_link(link)
    with pytest.raises(ValueError, match=r"^--output_dir .*run is a symbolic link to"):
        TrainingConfig(output_dir=str(link), report_to="none")
    with pytest.raises(ValueError, match=r"^--output_dir .*run is a symbolic link to"):
        FinetuneConfig(model="m", train_file="t", output_dir=str(link))
    check_writable_place(link)  # its target's place is writable: fine for a folder renamed into place
    (tmp_path / "elsewhere" / "run").mkdir(parents=True)
    check_not_dangling_link(link)  # made: fine


def test_an_unreadable_file_of_a_model_folder_is_named(tmp_path, monkeypatch):
    """safetensors reports a weights file this user may not read as missing ("No such file or
    directory"): a folder of another user's mode 0600 files was said not to hold its weights."""
    from conftest import tiny_config

    from vanilla_transformer import VanillaTransformerForConditionalGeneration
    from vanilla_transformer.evaluation import load_model_folder
    from vanilla_transformer.publishing import check_files_readable
    from vanilla_transformer.tokenization import train_bpe_tokenizer

    folder = tmp_path / "model"
    tokenizer = train_bpe_tokenizer(["a small text to learn from"] * 4, vocab_size=40)
    config = tiny_config(vocab_size=len(tokenizer))
    VanillaTransformerForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "nohup.out").write_text("another user's log")
    check_files_readable(folder)
    weights = folder / "model.safetensors"
    opening = Path.open

    def denied(self, *args, **kwargs):
        if self == weights:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return opening(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(PermissionError, match=r"model\.safetensors cannot be read \(Permission denied\)"):
        load_model_folder(folder, "cpu")
    weights = folder / "nohup.out"  # another user's log, which loading does not read: none of its business
    check_files_readable(folder)
