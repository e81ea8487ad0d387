"""Publishing a trained model folder to the Hugging Face Hub, checked before anything is sent."""

from __future__ import annotations

import fnmatch
import json
import logging
import re
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, ModelCard, constants, get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .publishing import check_folder_json, read_json_object, some_of

# What a folder written by the training script holds and a Hub user needs: weights (`WEIGHTS`),
# configuration with auto_map and custom_pipelines, the code they point to, tokenizer, generation
# defaults, card.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "configuration_vanilla_transformer.py",
    "modeling_vanilla_transformer.py",
    "kernels_vanilla_transformer.py",
    "pipeline_vanilla_transformer.py",
    "tokenizer_config.json",
    "README.md",
)
# A tokenizer's files: a fast tokenizer's, or the sentencepiece models of a converted OPUS-MT one.
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("source.spm", "target.spm", "vocab.json"))
# The weights: one file, or (`save_pretrained(..., max_shard_size=...)`) an index naming its shards.
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
# By-products that stay local, as patterns of top-level names: the training script's checkpoints, logs
# and tokenizer working copy; Seq2SeqTrainer's checkpoints, TensorBoard runs and arguments (finetune.py).
# What a file browser or a shell leaves in a folder, which nobody would miss or publish: hidden files
# (never uploaded), Windows' thumbnails and folder settings, a log the output is written to
# (`... | tee out/train.log`).
INCIDENTAL_FILES = ("*.log", "Thumbs.db", "desktop.ini")
LOCAL_ONLY = (
    "checkpoints",
    "logs",
    "tokenizer",
    "checkpoint-*",
    "runs",
    "training_args.bin",
    *INCIDENTAL_FILES,
)
# Files of a repo that an upload leaves alone although the folder does not have them: the Hub's own.
HUB_OWN = (".gitattributes",)
# What a model folder holds at its top level (this package's, a converted or a fine-tuned one): weights,
# configs, the package's code, tokenizers (fast, sentencepiece, BPE), the card, its metrics and plots.
# Anything else in a folder to publish is someone's own (notes, data: a .json or .py file is data or a
# script unless named as a model's) and goes up only when asked: a commit cannot be taken back.
# What a tokenizer's `save_pretrained` writes (fast, BPE, WordPiece, sentencepiece; Marian's two models).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.spm",
    "*.model",
)
MODEL_FILES = (
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    "*_vanilla_transformer.py",
    *TOKENIZER_FILES,
    "metrics.json",
    "*.png",
    "LICENSE*",  # the licence a card links (`license_link`), copied from the model it started from
    "LICENCE*",
)


def incidental(name: str) -> bool:
    """Whether a file or folder of this name is hidden or `INCIDENTAL_FILES`."""
    return name.startswith(".") or any(fnmatch.fnmatchcase(name, pattern) for pattern in INCIDENTAL_FILES)


def other_files(folder: str | Path, uploadable: list[Path] | None = None) -> list[str]:
    """The files under `folder` that an upload would send (`uploadable`, listed here if not given) and
    that are not a model folder's (`MODEL_FILES`, at the top level, and the licence file its card
    links), as paths relative to it."""
    folder = Path(folder)
    paths = _uploadable(folder) if uploadable is None else uploadable
    names = sorted(path.relative_to(folder).as_posix() for path in paths)
    licence = _linked_licence(folder)
    return [
        name
        for name in names
        if name != licence
        and ("/" in name or not any(fnmatch.fnmatchcase(name, pattern) for pattern in MODEL_FILES))
    ]


def _linked_licence(folder: Path) -> str | None:
    """The file of `folder` that its card's `license_link` names (a path inside it), if any."""
    try:
        link = ModelCard.load(folder / "README.md").data.license_link
    except Exception:  # no card, or one that cannot be read: check_model_folder says so
        return None
    return link.removeprefix("./") if isinstance(link, str) and (folder / link).is_file() else None


def _uploadable(folder: Path) -> list[Path]:
    """The files of `folder` an upload sends: not the local by-products (`LOCAL_ONLY`), nothing hidden."""
    return [
        path
        for path in folder.rglob("*")
        if path.is_file()
        and not any(fnmatch.fnmatchcase(path.relative_to(folder).parts[0], kept) for kept in LOCAL_ONLY)
        and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    ]


logger = logging.getLogger(__name__)


def check_repo_id(repo_id: str) -> str:
    """`namespace/name` (or `name`), as the Hub accepts it; a ValueError says what is wrong."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"Invalid Hub repo id {repo_id!r}: {error}") from None
    return repo_id


def resolve_token(token: str | None = None, flag: str | None = "--token") -> str:
    """The token to publish with: the argument, else HF_TOKEN or the one saved by `hf auth login`.
    `flag`: the caller's option that passes a token, named in the error (None: it has none)."""
    token = token or get_token()
    if not token:
        also = f", or pass {flag}" if flag else ""
        raise ValueError(f"No Hugging Face token: set HF_TOKEN or run `hf auth login`{also}.")
    return token


# The shards of a sharded save (`save_pretrained(max_shard_size=...)`), as transformers names them.
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def is_weights_file(name: str) -> bool:
    """Whether a repo's file `name` holds this model's weights, as one file or as an index and shards."""
    return name in (WEIGHTS, WEIGHTS_INDEX) or SHARD.fullmatch(name) is not None


def weight_files(folder: Path) -> list[str]:
    """The files of `folder`'s weights: `WEIGHTS`, else the shards that `WEIGHTS_INDEX` names (a sharded
    save, which transformers loads as well), present or not; none where it has neither. The index
    unreadable, or both forms in one folder (which loads the single file), is a ValueError."""
    if (folder / WEIGHTS).is_file():
        if (folder / WEIGHTS_INDEX).is_file():  # a sharded save over a single file leaves the file
            raise ValueError(
                f"{folder} holds both {WEIGHTS} and a sharded save's {WEIGHTS_INDEX}; transformers loads "
                f"{WEIGHTS} and ignores the shards. Remove whichever is stale."
            )
        return [WEIGHTS]
    if not (folder / WEIGHTS_INDEX).is_file():
        return []
    try:
        index = json.loads((folder / WEIGHTS_INDEX).read_text(encoding="utf-8"))
        return sorted(set(index["weight_map"].values()))
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(
            f"{folder}/{WEIGHTS_INDEX} is not a readable index of weight shards ({type(error).__name__}: "
            f"{error})."
        ) from None


def check_model_folder(folder: str | Path) -> ModelCard:
    """Raise unless `folder` is a complete trained model folder; returns its parsed model card.

    The card's YAML metadata is parsed by huggingface_hub (`ModelCard`/`ModelCardData`), including the
    model-index with the measured scores.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"No model folder at {folder}.")
    weights = weight_files(folder)
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if not weights:
        missing.append(f"{WEIGHTS} (or a sharded save's {WEIGHTS_INDEX} and its shards)")
    missing += [f"{name} (named in {WEIGHTS_INDEX})" for name in weights if not (folder / name).is_file()]
    if not any(all((folder / name).is_file() for name in names) for names in TOKENIZER_FILE_SETS):
        missing.append("tokenizer.json (or an OPUS-MT tokenizer's source.spm, target.spm and vocab.json)")
    if missing:
        card = (
            " The model card (README.md), with the model's measured scores, is written by scripts/train.py"
            " and finetune.py (for this package's models), by average_checkpoints.py (unless --no-card) and"
            " by convert_marian.py given a --test_file to score (a fine-tuned MarianMTModel folder too);"
            " for another folder, write one (as"
            " vanilla_transformer.model_card.write_model_card does) before publishing."
            if "README.md" in missing
            else ""
        )
        raise FileNotFoundError(
            f"{folder} is not a complete trained model folder (missing {', '.join(missing)}).{card}"
        )
    check_folder_json(folder)  # a broken generation_config.json would load as none, without a word
    config = read_json_object(folder / "config.json")
    if config.get("model_type") != "vanilla_transformer":
        raise ValueError(
            f"{folder} holds a {config.get('model_type')!r} model, not a vanilla_transformer one."
        )
    if "translation" not in (config.get("custom_pipelines") or {}) or "AutoModelForSeq2SeqLM" not in (
        config.get("auto_map") or {}
    ):
        raise ValueError(f"{folder}/config.json lacks auto_map or custom_pipelines; re-save the model.")
    try:  # the checks loading makes: a hand-edited value ("num_heads": 5, "dropout": "0.1") fails there
        VanillaTransformerConfig.from_dict(config)
    except ValueError as error:
        raise ValueError(f"{folder}/config.json: {error}") from None
    for name in weights:  # the header and the file's size, which must match it: no weights are read
        try:
            with safe_open(folder / name, framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise ValueError(
                f"{folder}/{name} is not readable ({error}): a save or a copy cut short leaves such a "
                "file, and the repo would not load. Save or copy the model again."
            ) from None
    try:
        card = ModelCard((folder / "README.md").read_text(encoding="utf-8"))
    except Exception as error:  # bytes that are not UTF-8, malformed YAML metadata (PyYAML's errors)
        raise ValueError(
            f"{folder}/README.md is not a readable model card (not UTF-8 text, or malformed YAML "
            f"metadata): {error}"
        ) from None
    if not card.data.eval_results:
        raise ValueError(f"The model card in {folder} has no model-index with results.")
    return card


def card_for_repo(text: str, repo_id: str) -> str:
    """A model card's text with its usage examples loading `repo_id`.

    The training script renders the card before the folder has a Hub name, so its examples load the
    card's `model_name` (the folder's name): `repo = "NAME"`, `model="NAME"`, `translate.py --model
    NAME`; a card published before (a downloaded snapshot pushed to another repo) loads its earlier
    repo id there. Those occurrences, and no other, become the repo id (a folder named "translation"
    or "en" leaves `pipeline("translation", ...)` and `batch["en"]` alone, and a recorded command's
    `--model` its start model); the rest of the text, the title and the model-index are left as they
    are.
    """
    name = ModelCard(text).data.model_name
    if not name:
        return text
    loaded = rf"(?:{re.escape(str(name))}|[\w.-]+/[\w.-]+)"  # the folder's name, or an earlier repo id
    forms = (rf'(repo = "){loaded}(")', rf'(model="){loaded}(")', rf"(translate\.py --model ){loaded}( )")
    for form in forms:
        text = re.sub(form, lambda match: f"{match[1]}{repo_id}{match[2]}", text)
    return text


def published_metrics(record: bytes) -> bytes:
    """A run's metrics.json as uploaded: the local paths of the data it scored (`scored_data`, absolute so
    that average_checkpoints.py finds them from other folders) reduced to file names, as the card names
    them; they told the world a user's folders ("/home/jdoe/clients/acme/test.tsv"). Anything else, and a
    file that is not such a record, as it is."""
    try:
        data = json.loads(record)
    except ValueError:
        return record
    scored = data.get("scored_data") if isinstance(data, dict) else None
    if not isinstance(scored, dict):
        return record
    for key, value in scored.items():
        if (
            (key.endswith("_file") or key == "dataset_name")
            and isinstance(value, str)
            and Path(value).is_absolute()
        ):
            scored[key] = Path(value).name
    return json.dumps(data, indent=1).encode()


def push_model_folder(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload vanilla_transformer model",
    endpoint: str | None = None,
    delete_other_files: bool = True,
    include_other_files: bool = False,
) -> str:
    """Create the repo if needed and upload the folder in one commit; returns the commit URL.

    The repo ends up holding the folder's files and no others: files an earlier upload left that the
    folder does not have are deleted in the same commit (they stay in the repo's history), because a
    load would read them with the new files (a `tokenizer.json` left by an earlier model is preferred
    over a converted OPUS-MT model's sentencepiece files); `delete_other_files=False` leaves them, but
    for the weights of the other layout (a `model.safetensors` beside a sharded upload's index, which a
    load would read instead of the new shards; an index and shards beside a new single file). The
    commit is made on the revision whose files were listed: if another lands in between, the Hub
    refuses it and nothing changes. The model card goes up with its usage examples loading the repo
    (`card_for_repo`; a `repo_id` without a namespace is the token owner's, and the card names it in
    full). Training by-products (`LOCAL_ONLY`) stay local. Files that are not a model folder's
    (`MODEL_FILES`; notes, data, anything in a subfolder) stop the upload before anything is sent,
    unless `include_other_files`. `private`: True creates the repo private, and refuses to upload into an
    existing public one (the Hub leaves an existing repo's visibility as it is); False creates it
    public; None leaves it to the namespace's default. `endpoint` selects another Hub deployment
    (default: HF_ENDPOINT or huggingface.co).
    """
    check_repo_id(repo_id)
    if not commit_message.strip():  # huggingface_hub refuses it only once the repo has been created
        raise ValueError("The commit message is empty; give one (--commit_message).")
    check_model_folder(folder)
    folder = Path(folder)
    api = HfApi(token=resolve_token(token), endpoint=endpoint)
    files = sorted(_uploadable(folder))
    others = other_files(folder, files)
    if others and not include_other_files:
        listed = some_of(others, 10)
        raise ValueError(
            f"{folder} holds files that are not a model folder's: {listed}. Nothing was uploaded; move them "
            "out, or publish them too with --include_other_files (include_other_files=True)."
        )
    operations = [
        CommitOperationAdd(path.relative_to(folder).as_posix(), str(path))
        for path in files
        if path.relative_to(folder).as_posix() not in ("README.md", "metrics.json")
    ]
    if (folder / "metrics.json").is_file():
        published = published_metrics((folder / "metrics.json").read_bytes())
        operations.append(CommitOperationAdd("metrics.json", published))
    repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    revision = constants.DEFAULT_REVISION  # where create_commit commits
    info = api.repo_info(repo.repo_id, repo_type="model", revision=revision)  # its commit
    if private and not info.private:
        raise ValueError(
            f"{repo.repo_id} already exists and is public, and the Hub does not change an existing repo's "
            "visibility: nothing was uploaded. Make it private on the Hub first, or choose another repo id."
        )
    card = card_for_repo((folder / "README.md").read_text(encoding="utf-8"), repo.repo_id)
    operations.append(CommitOperationAdd("README.md", card.encode()))
    uploaded = {operation.path_in_repo for operation in operations}
    # Listed at that commit: repo_info's `siblings` may be cut short by the Hub, the tree listing is not.
    remote = api.list_repo_files(repo.repo_id, revision=info.sha, repo_type="model")
    stale = sorted(name for name in remote if name not in uploaded and name not in HUB_OWN)
    if not delete_other_files:
        stale = [name for name in stale if is_weights_file(name)]
    if stale:
        logger.warning(
            "Deleting from %s what the folder does not have (kept in the repo's history): %s",
            repo.repo_id,
            ", ".join(stale)
            + ("" if delete_other_files else " (the other weights layout, which a load would read)"),
        )
        operations += [CommitOperationDelete(name) for name in stale]
    commit = api.create_commit(
        repo.repo_id,
        operations,
        commit_message=commit_message,
        repo_type="model",
        revision=revision,
        parent_commit=info.sha,
    )
    return commit.commit_url


__all__ = [
    "card_for_repo",
    "check_model_folder",
    "check_repo_id",
    "incidental",
    "other_files",
    "push_model_folder",
    "resolve_token",
]
