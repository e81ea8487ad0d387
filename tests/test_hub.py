"""Publishing to the Hub and loading back by repo id, against a Hub-compatible server on localhost.

huggingface.co cannot be reached here. `olah` (a self-hosted Hub mirror) serves the Hub's *download*
API for real from a local git repository: resolve, revisions, file listings. It has no upload API, so
the two calls through which uploads reach the network, `HfApi.create_repo` and `HfApi.create_commit`,
are redirected into that git repository. Everything above them is real (folder checks, file
selection, commit operations); the upload wire protocol itself (preupload, LFS/Xet) is not exercised
here. `test_real_hub_round_trip` does that, and runs only with a token and network access.
"""

import http.client
import http.server
import json
import os
import re
import runpy
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers.utils.hub
from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, RepoUrl

from tests.conftest import logged_messages, tiny_model
from vanilla_transformer.corpus import load_default_corpus
from vanilla_transformer.hub import card_for_repo, check_model_folder, push_model_folder
from vanilla_transformer.metrics import score_translations
from vanilla_transformer.model_card import write_model_card
from vanilla_transformer.tokenization import train_bpe_tokenizer
from vanilla_transformer.translation import translate

REPO_ID = "vanilla-tests/transformer-tiny-en-es"
SENTENCES = ["In the beginning, God created the heavens and the earth.", "Jesus wept."]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A small model folder as the training script writes it, with a card holding its measured scores."""
    folder = tmp_path_factory.mktemp("hub") / "model"
    test = load_default_corpus()["test"].select(range(8))
    tokenizer = train_bpe_tokenizer(list(test["en"]) * 5 + list(test["es"]) * 5 + SENTENCES * 5, 99)
    model = tiny_model(seed=4)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    hypotheses = translate(model, tokenizer, test["en"], num_beams=2, max_new_tokens=8)
    scores = score_translations(hypotheses, test["es"])
    write_model_card(
        folder,
        model_name="transformer-tiny-en-es",
        config=model.config,
        metrics={k: scores[k] for k in ("bleu", "chrf", "bleu_signature")},
        training={},
        dataset={"name": "WEB-derived / Reina-Valera 1909 Bible verses (en-es)", "test_pairs": len(test)},
        source_lang="en",
        target_lang="es",
    )
    (folder / "checkpoints" / "step-1").mkdir(parents=True)  # training by-products stay local
    (folder / "checkpoints" / "step-1" / "optimizer.bin").write_bytes(b"\0" * 16)
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True)
    return result.stdout.strip()


@pytest.fixture
def local_hub(tmp_path, monkeypatch):
    """olah on 127.0.0.1, serving git repositories under `mirrors/`, behind `NotFoundAs404`.

    Yields the endpoint clients use and the mirrors folder.
    """
    olah = shutil.which("olah-cli")
    assert olah, "olah-cli is missing: install the test extra, pip install -e '.[test]'"
    port, mirrors = free_port(), tmp_path / "mirrors"
    (mirrors / "models").mkdir(parents=True)
    config = tmp_path / "olah.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [basic]
            host = "127.0.0.1"
            port = {port}
            repos-path = "{tmp_path / "repos"}"
            mirror-netloc = "127.0.0.1:{port}"
            mirror-lfs-netloc = "127.0.0.1:{port}"
            mirrors-path = ["{mirrors}"]

            [accessibility]
            offline = true
            """
        )
    )
    log = (tmp_path / "olah.log").open("w")
    server = subprocess.Popen(
        [olah, "--config", str(config)], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=2)
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                assert server.poll() is None, (tmp_path / "olah.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "olah did not start within 60 s"
                time.sleep(0.3)
        handler = type("Handler", (NotFoundAs404,), {"upstream": f"127.0.0.1:{port}"})
        proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{proxy.server_address[1]}"
        redirect_uploads(monkeypatch, endpoint, mirrors)
        try:
            yield endpoint, mirrors
        finally:
            proxy.shutdown()
            proxy.server_close()
    finally:
        server.terminate()
        server.wait(timeout=20)
        log.close()


class NotFoundAs404(http.server.BaseHTTPRequestHandler):
    """Forwards to olah, answering 404 EntryNotFound where olah answers 401 for a missing file or folder.

    transformers probes optional files (tokenizer.model, chat templates, ...) and expects the Hub's 404
    for those it lacks; olah's 401 reads as "repository not found" and aborts the load.
    """

    upstream = ""  # "127.0.0.1:PORT", set per server

    def forward(self) -> None:
        connection = http.client.HTTPConnection(self.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        connection.request(self.command, self.path, headers=headers)
        response = connection.getresponse()
        body = response.read()
        status = 404 if response.status == 401 else response.status
        self.send_response(status)
        # A HEAD answer keeps olah's Content-Length: it announces the size of the file.
        dropped = ("transfer-encoding", "connection") + (
            () if self.command == "HEAD" else ("content-length",)
        )
        for key, value in response.getheaders():
            if key.lower() not in dropped:
                self.send_header(key, value)
        if status == 404:
            self.send_header("X-Error-Code", "EntryNotFound")
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        connection.close()

    do_GET = do_HEAD = forward

    def log_message(self, *args) -> None:
        pass


def commit(repo: Path, message: str) -> str:
    """Commit everything in `repo`; returns the commit's id."""
    git(repo, "add", "-A")
    git(
        repo,
        "-c",
        "user.name=test",
        "-c",
        "user.email=test@localhost",
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        message,
    )
    return git(repo, "rev-parse", "HEAD")


def redirect_uploads(monkeypatch, endpoint: str, mirrors: Path) -> None:
    """Replace create_repo and create_commit by writes and commits in olah's git repositories."""

    def create_repo(self, repo_id, *, private=False, exist_ok=False, repo_type=None, **kwargs):
        repo = mirrors / "models" / repo_id
        if (repo / ".git").is_dir() and not exist_ok:
            raise FileExistsError(repo_id)
        if not (repo / ".git").is_dir():  # the Hub creates a repo with one commit: its .gitattributes
            repo.mkdir(parents=True, exist_ok=True)
            git(repo, "init", "-q", "-b", "main")
            (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
            commit(repo, "initial commit")
        return RepoUrl(f"{endpoint}/{repo_id}", endpoint=endpoint)

    def create_commit(
        self, repo_id, operations, *, commit_message, repo_type=None, parent_commit=None, **kwargs
    ):
        repo = mirrors / "models" / repo_id
        if parent_commit is not None and parent_commit != git(repo, "rev-parse", "HEAD"):
            raise ValueError("the branch moved since parent_commit")  # the Hub answers 412
        for operation in operations:
            target = repo / operation.path_in_repo
            if isinstance(operation, CommitOperationAdd):
                target.parent.mkdir(parents=True, exist_ok=True)
                source = operation.path_or_fileobj
                if isinstance(source, (str, Path)):
                    shutil.copyfile(source, target)
                else:
                    target.write_bytes(source if isinstance(source, bytes) else source.read())
            elif isinstance(operation, CommitOperationDelete):
                target.unlink()
        oid = commit(repo, commit_message)
        return CommitInfo(f"{endpoint}/{repo_id}/commit/{oid}", commit_message, "", oid, _endpoint=endpoint)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)


def test_push_and_load_by_repo_id_without_the_package(model_folder, local_hub, tmp_path, monkeypatch):
    endpoint, mirrors = local_hub
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    # An earlier upload of another model left files this folder does not have; a load would read them.
    earlier = tmp_path / "earlier"
    shutil.copytree(model_folder, earlier, ignore=shutil.ignore_patterns("checkpoints"))
    for name in ("source.spm", "target.spm", "vocab.json"):  # a converted OPUS-MT tokenizer's files
        (earlier / name).write_bytes(b"earlier")
    push_model_folder(earlier, REPO_ID, token="hf_dummy", endpoint=endpoint)
    url = push_model_folder(model_folder, REPO_ID, token="hf_dummy", endpoint=endpoint)
    assert url.startswith(f"{endpoint}/{REPO_ID}/commit/")
    uploaded = set(git(mirrors / "models" / REPO_ID, "ls-files").splitlines())
    assert {"model.safetensors", "config.json", "README.md", "pipeline_vanilla_transformer.py"} <= uploaded
    assert not any(name.startswith("checkpoints/") for name in uploaded)
    # The repo holds the folder's files (and the Hub's .gitattributes); the earlier ones stay in its history.
    local = {p.relative_to(model_folder).as_posix() for p in model_folder.rglob("*") if p.is_file()}
    assert uploaded == {name for name in local if not name.startswith("checkpoints/")} | {".gitattributes"}
    assert git(mirrors / "models" / REPO_ID, "show", "HEAD~1:vocab.json") == "earlier"
    # The card's examples load the repo, not the name it was written under; the local card is unchanged.
    card = git(mirrors / "models" / REPO_ID, "show", "HEAD:README.md")
    assert f'repo = "{REPO_ID}"' in card and f'model="{REPO_ID}"' in card and f"--model {REPO_ID} " in card
    assert '"transformer-tiny-en-es"' not in card and "--model transformer-tiny-en-es " not in card
    assert 'repo = "transformer-tiny-en-es"' in (model_folder / "README.md").read_text()

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(model_folder)
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    expected = translate(model, tokenizer, SENTENCES, max_new_tokens=9)  # beam 4 by default

    script = textwrap.dedent(
        f"""
        import json, sys
        sys.modules["vanilla_transformer"] = None  # the package cannot be imported
        from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
        repo = {REPO_ID!r}
        config = AutoConfig.from_pretrained(repo, trust_remote_code=True)
        tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
        model = AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True)
        batch = tokenizer({SENTENCES!r}, padding=True, return_tensors="pt")
        batch.pop("token_type_ids", None)
        output_ids = model.generate(**batch, max_new_tokens=9)
        generated = tokenizer.batch_decode(output_ids, skip_special_tokens=True)
        translator = pipeline("translation", model=repo, trust_remote_code=True, device="cpu")  # as generate
        piped = [out["translation_text"] for out in translator({SENTENCES!r}, max_new_tokens=9)]
        print(json.dumps({{"type": config.model_type, "generated": generated, "piped": piped}}))
        """
    )
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_TOKEN": "hf_dummy",
        "HF_HOME": str(tmp_path / "hf_home"),
    }
    env.pop("HF_HUB_OFFLINE", None)
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outputs = json.loads(result.stdout.strip().splitlines()[-1])
    assert outputs["type"] == "vanilla_transformer"
    assert [t.strip() for t in outputs["generated"]] == expected
    assert outputs["piped"] == expected
    assert any((tmp_path / "hf_home").rglob("model.safetensors")), "the weights came over HTTP into the cache"


def test_a_sharded_save_is_published_and_loads_back(model_folder, local_hub, tmp_path):
    """`save_pretrained(..., max_shard_size=...)` writes an index and shards, no model.safetensors: such a
    folder, which transformers loads, was refused as "missing model.safetensors". A shard missing is
    named before anything is sent."""
    endpoint, mirrors = local_hub
    folder = tmp_path / "sharded"
    shutil.copytree(model_folder, folder, ignore=shutil.ignore_patterns("checkpoints", "model.safetensors"))
    model = tiny_model(seed=4)  # the folder's model
    model.save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(path.name for path in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (folder / "model.safetensors").exists()
    push_model_folder(folder, REPO_ID, token="hf_dummy", endpoint=endpoint)
    uploaded = set(git(mirrors / "models" / REPO_ID, "ls-files").splitlines())
    assert {*shards, "model.safetensors.index.json"} <= uploaded
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForSeq2SeqLM

    snapshot = snapshot_download(REPO_ID, endpoint=endpoint, token="hf_dummy", cache_dir=tmp_path / "cache")
    loaded = AutoModelForSeq2SeqLM.from_pretrained(snapshot)
    source = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.generate(source, max_new_tokens=8), model.generate(source, max_new_tokens=8))

    commits = git(mirrors / "models" / REPO_ID, "rev-list", "--count", "HEAD")
    # A sharded save over a folder with one weights file leaves that file, which loading prefers to the
    # new shards without a word: a folder with both is ambiguous, and refused.
    tiny_model(seed=5).save_pretrained(tmp_path / "single")
    shutil.copy(tmp_path / "single" / "model.safetensors", folder)
    assert not torch.equal(
        AutoModelForSeq2SeqLM.from_pretrained(folder).generate(source), model.generate(source)
    )
    with pytest.raises(ValueError, match=r"both model\.safetensors and a sharded save"):
        push_model_folder(folder, REPO_ID, token="hf_dummy", endpoint=endpoint)
    (folder / "model.safetensors").unlink()
    (folder / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"missing {shards[1]} \(named in model\.safetensors\.index"):
        push_model_folder(folder, REPO_ID, token="hf_dummy", endpoint=endpoint)
    assert git(mirrors / "models" / REPO_ID, "rev-list", "--count", "HEAD") == commits


def test_push_refuses_bad_input_before_uploading(model_folder, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: calls.append("create_repo"))
    monkeypatch.setattr(HfApi, "create_commit", lambda *a, **k: calls.append("create_commit"))
    with pytest.raises(ValueError, match="Invalid Hub repo id"):
        push_model_folder(model_folder, "not a repo id!", token="hf_dummy")
    with pytest.raises(FileNotFoundError, match=r"missing model\.safetensors"):
        empty = tmp_path / "incomplete"
        shutil.copytree(model_folder, empty, ignore=shutil.ignore_patterns("model.safetensors"))
        push_model_folder(empty, REPO_ID, token="hf_dummy")
    # Malformed files are named, not answered with a parser's traceback.
    broken = tmp_path / "broken"
    shutil.copytree(model_folder, broken, ignore=shutil.ignore_patterns("checkpoints"))
    card, config = ((model_folder / name).read_text() for name in ("README.md", "config.json"))
    for name, content, message in (
        ("config.json", "[1, 2]", r"config\.json holds a JSON list, not an object"),
        ("config.json", "{bad", r"config\.json is not valid JSON"),
        # Loading would refuse it; published, the repo would not load.
        (
            "config.json",
            config.replace('"num_heads": 4', '"num_heads": 5'),
            r"config\.json: `d_model` \(32\)",
        ),
        # transformers loads the model with none of its generation settings, without a word.
        ("generation_config.json", "{bad", r"generation_config\.json is not valid JSON"),
        ("README.md", card.replace("language:", "language: [unclosed", 1), "malformed YAML metadata"),
    ):
        (broken / name).write_text(content)
        with pytest.raises(ValueError, match=message):
            push_model_folder(broken, REPO_ID, token="hf_dummy")
        shutil.copy(model_folder / name, broken / name)
    # Weights cut short (a save or a copy interrupted): the repo would not load.
    weights = (model_folder / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is not readable \(.*not fully covered"):
        push_model_folder(broken, REPO_ID, token="hf_dummy")
    # huggingface_hub refuses an empty commit message only after creating the repo: refused here first.
    with pytest.raises(ValueError, match="commit message is empty"):
        push_model_folder(model_folder, REPO_ID, token="hf_dummy", commit_message=" ")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no_token_home"))
    with pytest.raises(ValueError, match="No Hugging Face token"):
        push_model_folder(model_folder, REPO_ID)
    assert calls == []
    card = check_model_folder(model_folder)
    assert card.data.pipeline_tag == "translation"
    assert json.loads((model_folder / "config.json").read_text())["custom_pipelines"]


@pytest.mark.skipif(
    not os.environ.get("HF_TOKEN") or os.environ.get("HF_HUB_OFFLINE") == "1",
    reason="needs HF_TOKEN and access to huggingface.co",
)
def test_real_hub_round_trip(model_folder, tmp_path):
    api = HfApi()
    repo_id = f"{api.whoami()['name']}/vanilla-transformer-test-{os.getpid()}"
    try:
        push_model_folder(model_folder, repo_id, private=True)
        from transformers import AutoModelForSeq2SeqLM

        loaded = AutoModelForSeq2SeqLM.from_pretrained(repo_id, trust_remote_code=True, cache_dir=tmp_path)
        assert loaded.config.model_type == "vanilla_transformer"
    finally:
        api.delete_repo(repo_id, missing_ok=True)


def test_save_pretrained_with_push_to_hub_uploads_the_pipeline(tmp_path, monkeypatch):
    """transformers uploads inside `save_pretrained`, and the pipeline file was once copied after that:
    the repository's config named a pipeline the repository did not hold."""
    uploaded: list[str] = []

    def create_repo(self, repo_id, **kwargs):
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        uploaded.extend(operation.path_in_repo for operation in operations)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    # push_to_hub starts from the repository's card, which would be asked of huggingface.co (with retries,
    # 20 s offline); `save_pretrained` calls modeling_utils' own import of that function.
    for module in (transformers.utils.hub, transformers.modeling_utils):
        monkeypatch.setattr(module, "create_and_tag_model_card", lambda *a, **k: ModelCard("x"))
    tiny_model().save_pretrained(tmp_path / "model", push_to_hub=True, repo_id="someone/tiny", token="x")
    assert {"config.json", "model.safetensors", "pipeline_vanilla_transformer.py"} <= set(uploaded)
    assert (tmp_path / "model" / "pipeline_vanilla_transformer.py").is_file()  # the local folder too


@pytest.mark.parametrize("name", ["translation", "en", "es", "my run"])
def test_card_for_repo_rewrites_only_the_loading_examples(tmp_path, name):
    # A folder named like a quoted word of the card (a pipeline task, a language column) keeps that word;
    # one with a space is replaced whole (the translate command became `--model NAME/REPO run`).
    write_model_card(
        tmp_path,
        model_name=name,
        config=tiny_model(seed=0).config,
        metrics={"bleu": 1.0, "chrf": 2.0, "bleu_signature": "nrefs:1"},
        training={},
        dataset={"name": "d", "test_pairs": 1},
        source_lang="en",
        target_lang="es",
    )
    text = (tmp_path / "README.md").read_text()
    # Without trust_remote_code a Hub user's AutoTokenizer asks for it at the terminal (15 s, then runs).
    loads = re.findall(r"from_pretrained\(repo[^)]*\)", text)
    assert len(loads) >= 4 and all("trust_remote_code=True" in load for load in loads), loads
    card = card_for_repo(text, REPO_ID)
    assert f'repo = "{name}"' in text and f'model="{name}"' in text
    assert f'repo = "{name}"' not in card and f'model="{name}"' not in card
    assert f'repo = "{REPO_ID}"' in card and f'model="{REPO_ID}"' in card
    assert f"translate.py --model {REPO_ID} --input" in card
    for kept in ('pipeline("translation"', 'batch["en"]', 'batch["es"]'):
        assert card.count(kept) == text.count(kept) > 0
    # A published card (a downloaded snapshot) pushed to another repo loads that repo: it kept loading
    # the first one. (The start model that a recorded command names is not the model.)
    command = "python scripts/finetune.py --model org/start --output_dir x\n"
    card = card.replace("## Results", command + "## Results")
    moved = card_for_repo(card, "acme/translator-en-es")
    assert "finetune.py --model org/start " in moved
    assert REPO_ID not in moved.split("---", 2)[2]
    assert moved.count("acme/translator-en-es") == card.count(REPO_ID) > 0


@pytest.mark.parametrize("sharded", [False, True])
def test_other_files_kept_are_never_the_other_weights_layout(model_folder, tmp_path, monkeypatch, sharded):
    """`delete_other_files=False` (--keep_other_files) pushing a sharded save over a single file left the
    repo's model.safetensors, which loads instead of the new shards, without a word (and an index with
    its shards beside a new single file); the other weights layout is deleted with the new upload."""
    single = ["model.safetensors"]
    shards = [
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    commits = []
    monkeypatch.setattr(
        HfApi, "create_repo", lambda self, repo_id, **kwargs: RepoUrl(f"https://hf.co/{repo_id}")
    )
    monkeypatch.setattr(
        HfApi, "repo_info", lambda self, *args, **kwargs: types.SimpleNamespace(private=False, sha="1")
    )
    earlier = single if sharded else shards
    monkeypatch.setattr(HfApi, "list_repo_files", lambda self, *args, **kwargs: [*earlier, "onnx/model.onnx"])

    def create_commit(self, repo_id, operations, **kwargs):
        commits.append(operations)
        return types.SimpleNamespace(commit_url="https://hf.co/x/commit/1")

    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    if sharded:
        model = tiny_model(seed=4)
        (folder / "model.safetensors").unlink()
        model.save_pretrained(folder, max_shard_size="20KB")
    with logged_messages("vanilla_transformer.hub") as messages:
        push_model_folder(folder, "alice/tiny", token="hf_dummy", delete_other_files=False)
    deleted = {op.path_in_repo for op in commits[-1] if isinstance(op, CommitOperationDelete)}
    uploaded = {op.path_in_repo for op in commits[-1] if not isinstance(op, CommitOperationDelete)}
    assert deleted == set(earlier) - uploaded and deleted  # onnx/model.onnx kept, as asked
    assert any("the other weights layout" in message for message in messages)


def test_the_licence_file_a_card_links_is_published_with_the_folder(model_folder, tmp_path):
    """A fine-tuned or converted folder carries its start model's licence file (`copy_license_file`), which
    the upload refused as not a model folder's; the file the card links, in a subfolder too, goes up."""
    from vanilla_transformer.hub import other_files

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    (folder / "LICENSE").write_text("terms")
    assert other_files(folder) == []
    (folder / "docs").mkdir()
    (folder / "docs" / "TERMS.md").write_text("terms")
    assert other_files(folder) == ["docs/TERMS.md"]
    card = ModelCard((folder / "README.md").read_text(encoding="utf-8"))
    card.data.license, card.data.license_link = "other", "docs/TERMS.md"
    (folder / "README.md").write_text(str(card), encoding="utf-8")
    assert other_files(folder) == []


def test_push_script_names_an_unreachable_hub_in_one_line(model_folder):
    """A connection error is not an OSError: it once ended the script with a traceback."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "push_to_hub.py"
    command = [sys.executable, str(script), "--folder", str(model_folder), "--repo_id", REPO_ID]
    environment = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_TOKEN": "hf_dummy"}
    result = subprocess.run(
        [*command], env=environment, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "error: publishing to the Hub failed: " in result.stderr and "Traceback" not in result.stderr


def test_push_names_the_repo_in_full_keeps_local_files_and_honours_private(
    model_folder, tmp_path, monkeypatch
):
    """A bare repo id is the token owner's: the card's examples name it in full. A repo that exists and is
    public is not uploaded into when `private=True` asks otherwise; unset, the namespace's default holds."""
    created, commits, public = [], [], {"alice/earlier-public"}

    def create_repo(self, repo_id, *, private=None, **kwargs):
        created.append((repo_id, private))
        return RepoUrl(f"https://huggingface.co/{repo_id if '/' in repo_id else 'alice/' + repo_id}")

    def repo_info(self, repo_id, **kwargs):
        return types.SimpleNamespace(private=repo_id not in public, sha="f00d")

    def list_repo_files(self, repo_id, *, revision=None, **kwargs):  # an earlier upload's files
        assert revision == "f00d"  # listed at the commit the upload builds on
        return [".gitattributes", "README.md", "config.json", "spiece.model", "onnx/model.onnx"]

    def create_commit(self, repo_id, operations, *, parent_commit=None, **kwargs):
        assert parent_commit == "f00d"  # the revision whose files were listed
        commits.append((repo_id, {op.path_in_repo: op for op in operations}))
        return types.SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/1")

    for name, method in (
        ("create_repo", create_repo),
        ("repo_info", repo_info),
        ("list_repo_files", list_repo_files),
        ("create_commit", create_commit),
    ):
        monkeypatch.setattr(HfApi, name, method)
    folder = tmp_path / "finetuned"
    shutil.copytree(model_folder, folder)
    for by_product in ("checkpoint-10/optimizer.pt", "runs/events.out", "training_args.bin"):
        (folder / by_product).parent.mkdir(parents=True, exist_ok=True)
        (folder / by_product).write_bytes(b"\0")  # what Seq2SeqTrainer leaves (finetune.py)
    # A run's record of the data it scored keeps absolute paths locally (average_checkpoints.py reads
    # them); uploaded, they told the world a user's folders: names only there.
    scored = {"test_file": str(tmp_path / "clients" / "acme" / "test.tsv"), "source_lang": "en"}
    record = {"metrics": {"bleu": 1.0}, "scored_data": scored}
    (folder / "metrics.json").write_text(json.dumps(record))
    push_model_folder(folder, "tiny-en-es", token="hf_dummy")
    assert created == [("tiny-en-es", None)]  # visibility: the namespace's default
    repo_id, files = commits[-1]
    uploaded = json.loads(files["metrics.json"].path_or_fileobj)
    assert uploaded == {**record, "scored_data": {"test_file": "test.tsv", "source_lang": "en"}}
    assert json.loads((folder / "metrics.json").read_text()) == record
    card = files["README.md"].path_or_fileobj.decode()
    assert repo_id == "alice/tiny-en-es" and 'repo = "alice/tiny-en-es"' in card
    assert not any(name.split("/")[0] in {"checkpoints", "checkpoint-10", "runs"} for name in files)
    assert "training_args.bin" not in files and "kernels_vanilla_transformer.py" in files
    deleted = {name for name, op in files.items() if isinstance(op, CommitOperationDelete)}
    assert deleted == {"spiece.model", "onnx/model.onnx"}  # not .gitattributes, nor what is replaced
    push_model_folder(folder, "tiny-en-es", token="hf_dummy", delete_other_files=False)
    assert not any(isinstance(op, CommitOperationDelete) for op in commits[-1][1].values())
    with pytest.raises(ValueError, match="already exists and is public"):
        push_model_folder(folder, "alice/earlier-public", token="hf_dummy", private=True)
    assert len(commits) == 2  # nothing uploaded
    push_model_folder(folder, "alice/new-private", token="hf_dummy", private=True)
    assert created[-1] == ("alice/new-private", True) and commits[-1][0] == "alice/new-private"
    # A user's own files in the folder went up with the model, unlisted; now only when asked.
    (folder / "notes.txt").write_text("private")
    (folder / "mydata").mkdir()
    (folder / "mydata" / "pairs.tsv").write_text("en\tes\n")
    (folder / "valid.json").write_text("[]")  # data of a format the loader reads, not a model's JSON
    (folder / "train.log").write_text("")  # local, as the logs folder
    refused = r"not a model folder's: mydata/pairs\.tsv, notes\.txt, valid\.json\. Nothing"
    with pytest.raises(ValueError, match=refused):
        push_model_folder(folder, "tiny-en-es", token="hf_dummy")
    assert len(commits) == 3 and len(created) == 4  # refused before the Hub was asked anything
    push_model_folder(folder, "tiny-en-es", token="hf_dummy", include_other_files=True)
    assert {"notes.txt", "mydata/pairs.tsv", "valid.json"} <= set(commits[-1][1])
    assert "train.log" not in commits[-1][1]


def test_a_folder_needs_the_kernels_file_and_a_tokenizer_of_either_kind(model_folder, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(model_folder, folder)
    (folder / "kernels_vanilla_transformer.py").unlink()  # modeling imports it: loading would fail
    with pytest.raises(FileNotFoundError, match=r"missing kernels_vanilla_transformer\.py"):
        check_model_folder(folder)
    shutil.copy(model_folder / "kernels_vanilla_transformer.py", folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing tokenizer\.json \(or an OPUS-MT tokenizer's"):
        check_model_folder(folder)
    for name in ("source.spm", "target.spm", "vocab.json"):  # a converted OPUS-MT model's tokenizer
        (folder / name).write_bytes(b"x")
    check_model_folder(folder)


def test_push_script_stops_on_ctrl_c_without_a_traceback(model_folder, monkeypatch, capsys):
    """Ctrl-C during the upload ended the script with a traceback and status 1."""

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(HfApi, "create_repo", interrupted)
    script = Path(__file__).resolve().parents[1] / "scripts" / "push_to_hub.py"
    argv = [str(script), "--folder", str(model_folder), "--repo_id", REPO_ID, "--token", "hf_dummy"]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stopped:
        assert stopped.code == 130
    except KeyboardInterrupt:  # caught here: escaping, it would stop the whole test session
        pytest.fail("the KeyboardInterrupt escaped the script (a traceback)")
    else:
        pytest.fail("the script went on after Ctrl-C")
    assert capsys.readouterr().err.startswith("interrupted: the upload is one commit")
