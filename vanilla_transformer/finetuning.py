"""Fine-tuning a trained model folder with transformers' `Seq2SeqTrainer` on local parallel text.

The standard transformers path, for users who already know it: `AutoModelForSeq2SeqLM`,
`DataCollatorForSeq2Seq` (which builds the shifted decoder inputs with the model's
`prepare_decoder_input_ids_from_labels`), `Seq2SeqTrainingArguments` with label smoothing and gradient
accumulation, and evaluation by beam search (`predict_with_generate`) scored with sacreBLEU.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import SequentialSampler
from transformers import (
    EvalPrediction,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)
from transformers.trainer_callback import TrainerState
from transformers.trainer_pt_utils import LabelSmoother, LengthGroupedSampler
from transformers.trainer_utils import has_length

from .cli import InputError, json_field, replaced_when_complete
from .configuration_vanilla_transformer import VanillaTransformerConfig
from .evaluation import load_model_folder
from .machine import (
    describe_machine,
    distributed_accelerator,
    format_machine,
    one_process_of_several,
    processes_without_a_gpu,
    training_leaves_mps,
)
from .metrics import score_translations
from .model_card import base_license, copy_license_file, decoding_settings, write_model_card
from .parallel_data import (
    check_data_paths,
    load_parallel_data,
    resolve_languages,
    seq2seq_collator,
    text_digest,
    tokenize_parallel_data,
)
from .publishing import check_not_dangling_link, check_writable_place, disk_full_message
from .translation import after_start_token, decoder_start_id

logger = logging.getLogger(__name__)


@dataclass
class FinetuneConfig:
    """Every option of `scripts/finetune.py`."""

    model: str = field(metadata={"help": "trained model folder (or Hub id) to start from"})
    train_file: str = field(metadata={"help": "local .tsv/.csv/.jsonl training file"})
    output_dir: str = field(metadata={"help": "where checkpoints and the fine-tuned model go"})
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "load a --model holding model code of its own, running it (this package's: none)"},
    )
    validation_file: str | None = field(default=None, metadata={"help": "default: hold out part of train"})
    source_lang: str | None = field(default=None, metadata={"help": "default en (needed with a column)"})
    target_lang: str | None = field(default=None, metadata={"help": "default es (needed with a column)"})
    source_column: str | None = None
    target_column: str | None = None
    max_length: int = field(default=128, metadata={"help": "longest training sentence in tokens"})
    max_steps: int = 200
    learning_rate: float = 1e-4
    warmup_steps: int = 20
    per_device_train_batch_size: int = 32
    per_device_eval_batch_size: int = 32
    gradient_accumulation_steps: int = 1
    label_smoothing_factor: float = field(default=0.1, metadata={"help": "the paper's epsilon_ls"})
    unlikelihood_weight: float | None = field(
        default=None, metadata={"help": "unlikelihood term's weight (default: the model's own)"}
    )
    eval_steps: int = 100
    num_beams: int = field(default=4, metadata={"help": "beam size when evaluating"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "evaluate on the first N pairs"})
    validation_size: int = field(default=500, metadata={"help": "pairs held out when no validation_file"})
    seed: int = 0
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "continue an interrupted fine-tune: a checkpoint-N folder, or 'latest' in --output_dir"
        },
    )

    def __post_init__(self) -> None:
        resolve_languages(self)
        positive = ["max_length", "max_steps", "per_device_train_batch_size", "per_device_eval_batch_size"]
        positive += ["gradient_accumulation_steps", "eval_steps", "num_beams", "validation_size"]
        positive += [] if self.max_eval_samples is None else ["max_eval_samples"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}.")
        if self.warmup_steps <= 0:  # transformers' inverse_sqrt would then decay on a 10,000-step timescale
            raise ValueError(
                f"--warmup_steps must be positive, got {self.warmup_steps}: the inverse square-root schedule "
                "warms up first (without, transformers' version decays over 10,000 steps instead)."
            )
        if not 0 <= self.seed < 2**32:  # what numpy's generator, which Trainer seeds, accepts
            raise ValueError(f"--seed must be between 0 and 2**32 - 1, got {self.seed}.")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"--learning_rate must be a positive finite number, got {self.learning_rate}.")
        if not 0 <= self.label_smoothing_factor < 1:  # NaN included
            raise ValueError("--label_smoothing_factor must be in [0, 1).")
        if self.unlikelihood_weight is not None and not (
            math.isfinite(self.unlikelihood_weight) and self.unlikelihood_weight >= 0
        ):
            raise ValueError(
                f"--unlikelihood_weight must be a non-negative finite number, got {self.unlikelihood_weight}."
            )
        # The fine-tuned model must not overwrite the one it starts from, nor land beside another model's
        # files (its card and scores would describe the wrong weights).
        if not self.output_dir.strip():  # Path("") is the current folder; Trainer failed on it after loading
            raise ValueError("--output_dir is empty: name a new folder for the fine-tuned model.")
        output = Path(self.output_dir)
        if output.exists() and not output.is_dir():
            raise ValueError(f"--output_dir {self.output_dir} is a file; name a folder.")
        try:  # under a file, or read-only: refused before any work, not after training
            check_writable_place(output)
            check_not_dangling_link(output)
        except ValueError as error:
            raise ValueError(f"--output_dir {error}") from None
        if Path(self.model).exists() and output.exists() and output.resolve() == Path(self.model).resolve():
            raise ValueError(f"--output_dir {self.output_dir} is the --model folder; name a new folder.")
        checkpoint = self.checkpoint_to_resume()
        # A fine-tune resumed in its own folder may have written its model there before it was stopped
        # (in the final evaluation or save): that is replaced.
        own = checkpoint is not None and checkpoint.resolve().parent == output.resolve()
        if not own and ((output / "config.json").exists() or (output / "model.safetensors").exists()):
            # A fine-tune killed while saving its model leaves a config beside its checkpoints: say how to
            # finish it (the model is then written again from its last checkpoint).
            resumable = checkpoint is None and complete_checkpoints(output)
            finish = (
                f" (or finish the fine-tune whose checkpoints it holds, {resumable[0].name} the last: "
                "--resume_from_checkpoint latest, with its flags)"
                if resumable
                else ""
            )
            raise ValueError(
                f"--output_dir {self.output_dir} already holds a model; name a new folder{finish}."
            )
        if not own and (output / "README.md").exists():  # the fine-tuned model's card is written there
            raise ValueError(f"--output_dir {self.output_dir} holds a README.md; name a new folder.")
        # Seq2SeqTrainer keeps its last two checkpoints in --output_dir: a new fine-tune there would
        # delete an interrupted one's.
        earlier = sorted(p.name for p in output.glob("checkpoint-*") if p.is_dir()) if output.is_dir() else []
        if earlier and checkpoint is None:
            if not complete_checkpoints(output):
                raise ValueError(
                    f"--output_dir {self.output_dir} holds {', '.join(earlier)}, incomplete (a fine-tune "
                    "stopped while writing it, before any checkpoint was whole): delete it, or name a new "
                    "folder."
                )
            raise ValueError(
                f"--output_dir {self.output_dir} holds the checkpoints of an earlier fine-tune "
                f"({', '.join(earlier)}), which this one would delete: continue it with "
                "--resume_from_checkpoint latest (and its flags), or name a new folder."
            )
        if checkpoint is not None:
            step = checkpoint_step(checkpoint)
            if step > self.max_steps:
                raise ValueError(
                    f"--resume_from_checkpoint {checkpoint} is at step {step}, past --max_steps "
                    f"{self.max_steps}: resume with the --max_steps it was trained with (or a larger one)."
                )
            changed = changed_flags(checkpoint, self)
            if changed:
                raise ValueError(
                    f"--resume_from_checkpoint {checkpoint} was trained with other flags "
                    f"({'; '.join(changed)}): a resumed fine-tune keeps its optimizer, schedule and data "
                    "order; resume with the flags it was trained with, or start a new fine-tune."
                )
            # (Checkpoints that record no flags.) The scheduler's state, restored on resume, holds the
            # learning rate the checkpoint's run started with: Trainer would keep that one and the card
            # would state this one.
            trained_lr = checkpoint_learning_rate(checkpoint)
            if trained_lr is not None and not math.isclose(trained_lr, self.learning_rate, rel_tol=1e-6):
                raise ValueError(
                    f"--resume_from_checkpoint {checkpoint} was trained with --learning_rate {trained_lr:g}, "
                    f"not {self.learning_rate:g}: a resumed schedule keeps its learning rate; resume with "
                    "the flags it was trained with."
                )
            if earlier and not own:
                raise ValueError(
                    f"--output_dir {self.output_dir} holds the checkpoints of another fine-tune "
                    f"({', '.join(earlier)}) than --resume_from_checkpoint {checkpoint}'s, which this one "
                    "would delete: name a new folder (or resume that fine-tune from one of them)."
                )

    def checkpoint_to_resume(self) -> Path | None:
        """The checkpoint `--resume_from_checkpoint` names: for "latest", the newest whole checkpoint-N
        folder in --output_dir (one stopped while written is skipped; Trainer's `get_last_checkpoint`
        would take it). None when not resuming; raises where there is nothing to resume from."""
        if self.resume_from_checkpoint is None:
            return None
        output = Path(self.output_dir)
        if self.resume_from_checkpoint != "latest":
            checkpoint = Path(self.resume_from_checkpoint)
            if checkpoint_step(checkpoint) is None:  # train.py's checkpoints have a trainer_state.json too
                raise ValueError(
                    f"--resume_from_checkpoint {checkpoint} is not a whole checkpoint of a fine-tune (a "
                    "checkpoint-N folder whose trainer_state.json, which Trainer writes last, has its "
                    "global_step)."
                )
            return checkpoint
        complete = complete_checkpoints(output)
        if not complete:
            found = (
                sorted(p.name for p in output.glob("checkpoint-*") if p.is_dir()) if output.is_dir() else []
            )
            whole = f" whole ({', '.join(found)}: stopped while written)" if found else ""
            raise ValueError(
                f"--resume_from_checkpoint latest: {self.output_dir} holds no{whole} checkpoint-N folder."
            )
        return complete[0]


def checkpoint_step(checkpoint: Path) -> int | None:
    """The step of a fine-tune's checkpoint folder: its trainer_state.json's global_step (Trainer writes
    that file after everything else); None where it has none (unfinished, or not Trainer's)."""
    step = json_field(checkpoint / "trainer_state.json", "global_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def checkpoint_learning_rate(checkpoint: Path) -> float | None:
    """The peak learning rate a fine-tune's checkpoint was trained with (its scheduler's base rate), or
    None where its scheduler.pt is missing or unreadable."""
    try:
        state = torch.load(checkpoint / "scheduler.pt", map_location="cpu", weights_only=True)
        return float(state["base_lrs"][0])
    except Exception:  # no file, or not a LambdaLR state: Trainer's own loading says what is wrong
        return None


# A fine-tune's checkpoints record the flags that shape what it trains (`FinetuneTrainer`), so that a
# resume with other ones is refused: Trainer restores the optimizer, the schedule (with its learning rate)
# and the data order, and would train on as before while the card stated the new flags.
FLAGS_FILE = "finetune_flags.json"
RESUME_FLAGS = (
    "model",
    "train_file",
    "validation_file",
    "source_lang",
    "target_lang",
    "source_column",
    "target_column",
    "max_length",
    "learning_rate",
    "warmup_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "label_smoothing_factor",
    "unlikelihood_weight",
    "validation_size",
    "seed",
)
PATH_FLAGS = ("model", "train_file", "validation_file")


def resume_flags(config: FinetuneConfig) -> dict[str, Any]:
    """The flags a resumed fine-tune must keep, local paths made absolute (a resume may run elsewhere),
    and the number of processes launched, which shapes the updates and the batches a resume skips as the
    batch size does."""
    flags = {name: getattr(config, name) for name in RESUME_FLAGS}
    for name in PATH_FLAGS:
        if flags[name] is not None and Path(flags[name]).exists():
            flags[name] = str(Path(flags[name]).resolve())
    return flags | {"processes": int(os.environ.get("WORLD_SIZE", "1"))}


def recorded_flags(checkpoint: Path) -> dict[str, Any]:
    """The flags `checkpoint` recorded (`resume_flags` and its training pairs); {} for a checkpoint written
    before flags were recorded, which is not checked."""
    try:
        return json.loads((checkpoint / FLAGS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def changed_flags(checkpoint: Path, config: FinetuneConfig) -> list[str]:
    """The recorded flags of `checkpoint` that `config` gives other values ("--name old -> new")."""
    recorded = recorded_flags(checkpoint)
    now = resume_flags(config)
    changed = [
        f"--{name} {recorded[name]} -> {now[name]}"
        for name in RESUME_FLAGS
        if name in recorded and recorded[name] != now[name]
    ]
    if recorded.get("processes", now["processes"]) != now["processes"]:
        changed.append(
            f"{recorded['processes']} processes -> {now['processes']}, launched with --num_processes "
            "(accelerate launch) or --nproc_per_node (torchrun)"
        )
    return changed


def check_training_data(checkpoint: Path, record: dict[str, Any], train_file: str) -> None:
    """Refuse to resume from `checkpoint` on other training pairs than those it was trained on (`record`:
    their count and `text_digest`, and how a validation split held out of them was drawn). Only the
    file's path was compared: with the file edited in place, Trainer skipped the batches already trained
    by count over other data, and the card stated the new data as the whole fine-tune's."""
    recorded = recorded_flags(checkpoint)
    # A checkpoint written before the held-out validation split was drawn by source sentence (it records
    # no draw) was trained on another split of the same file: resumed, it would validate on pairs it
    # trained on. Those without a digest could not be told apart otherwise.
    drawn = record.get("validation_draw")
    earlier_draw = bool(recorded) and drawn is not None and recorded.get("validation_draw") != drawn
    if earlier_draw and "train_sha256" not in recorded:
        raise InputError(
            f"--resume_from_checkpoint {checkpoint} was written by an earlier version of this package, which "
            f"held its validation pairs out of --train_file {train_file} pair by pair; this one draws them "
            "by source sentence, another split: resumed, it would validate on pairs it trained on. Start a "
            "new fine-tune, or resume with --validation_file holding the pairs it validated on."
        )
    if recorded.get("train_sha256", record["train_sha256"]) != record["train_sha256"]:
        why = (
            "the validation pairs are now held out otherwise (by source sentence, to the size asked), "
            "another split of the same file"
            if earlier_draw
            else "their text differs"
        )
        raise InputError(
            f"--resume_from_checkpoint {checkpoint} was trained on other pairs than --train_file "
            f"{train_file} gives now ({recorded['train_pairs']} then, {record['train_pairs']} now, after "
            f"the held-out validation pairs and the length filter; {why}): resume with the data it was "
            "trained on, or start a new fine-tune."
        )


def complete_checkpoints(output: Path) -> list[Path]:
    """The whole checkpoint-N folders in `output`, newest first."""
    if not output.is_dir():
        return []
    found = [p for p in output.glob("checkpoint-*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step, reverse=True)


class BleuMetric:
    """`compute_metrics` for `Seq2SeqTrainer(predict_with_generate=True)`: corpus BLEU and chrF.

    `references`: the evaluation dataset (its `target` texts and `labels`), whose texts are scored
    against when the labels are its labels, in order; otherwise the references are the labels decoded,
    which lose what the tokenizer cannot represent (characters outside its vocabulary become `<unk>`
    and vanish, normalisation rewrites others), so scores would not match `evaluate_model`'s.
    `scores`: the last evaluation's sacreBLEU results, signatures included, and `split_pairs` the size of
    the split whose first pairs `references` are (both for the model card). `target_lang`, the
    references' language code, picks sacreBLEU's BLEU tokeniser for it (`score_translations`).
    `decoder_start_token_id`, the model's: the token generated sequences begin with, scored (and counted
    in `gen_len`) as no part of the translation."""

    def __init__(
        self,
        tokenizer: Any,
        references: Any = None,
        split_pairs: int | None = None,
        target_lang: str | None = None,
        decoder_start_token_id: int | None = None,
    ) -> None:
        self.tokenizer, self.references, self.split_pairs = tokenizer, references, split_pairs
        self.target_lang, self.decoder_start_token_id = target_lang, decoder_start_token_id
        self.scores: dict[str, Any] = {}

    def __call__(self, prediction: EvalPrediction) -> dict[str, float]:
        tokenizer, references = self.tokenizer, self.references
        predictions, labels = prediction.predictions, prediction.label_ids
        if isinstance(predictions, tuple):
            predictions = predictions[0]
        # Padding of generated sequences and of labels is -100 after gathering: decode it as pad.
        predictions = np.where(predictions != -100, predictions, tokenizer.pad_token_id)
        # after the decoder's start token that begins each generated sequence (`translate`)
        predictions = after_start_token(predictions.tolist(), self.decoder_start_token_id)
        hypotheses = [t.strip() for t in tokenizer.batch_decode(predictions, skip_special_tokens=True)]
        # Seq2SeqTrainer pads the labels of a batch shorter than the generation config's `max_length` (20
        # once its defaults are filled in) with the pad id, not -100; no label is the pad token itself.
        padding = np.isin(labels, [-100, tokenizer.pad_token_id])
        rows = [row[~pad].tolist() for row, pad in zip(labels, padding, strict=True)]
        if references is not None and rows == list(references["labels"]):
            texts = [t.strip() for t in references["target"]]
        else:
            labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
            texts = [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        self.scores = score_translations(hypotheses, texts, target_lang=self.target_lang)
        # the generated tokens, without the start token (for Marian, whose start token is the pad token, the
        # same count as over the whole row)
        lengths = [sum(token != tokenizer.pad_token_id for token in row) for row in predictions]
        return {"bleu": self.scores["bleu"], "chrf": self.scores["chrf"], "gen_len": float(np.mean(lengths))}


bleu_metric_fn = BleuMetric  # its earlier name


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """Trainer's length-grouped order, drawn from `seed` and the epoch (`epoch()`, read when an epoch
    starts) rather than from the global RNG: every process must draw the same order, which Accelerate
    then shards, and the global RNG differs between processes once dropout has drawn from it for batches
    of different shapes (from the second epoch on, some pairs were trained twice per epoch and others
    not at all)."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int, epoch: Callable[[], int]):
        super().__init__(batch_size, lengths=lengths)
        self.seed, self.epoch = seed, epoch

    def __iter__(self) -> Iterator[int]:
        self.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch())
        return super().__iter__()


class FinetuneTrainer(Seq2SeqTrainer):
    """`Seq2SeqTrainer` whose evaluation scores every validation pair once, in the split's order (so that
    `BleuMetric` scores against the reference texts), also on several processes."""

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler | None:
        sampler = super()._get_train_sampler(train_dataset)
        if type(sampler) is not LengthGroupedSampler or sampler.generator is not None:
            return sampler
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        # The epoch the loop is in (after a resume too: the state is restored before the epoch starts).
        return EpochSeededLengthGroupedSampler(
            sampler.batch_size, sampler.lengths, seed, lambda: math.floor((self.state.epoch or 0) + 1e-9)
        )

    def __init__(self, *args: Any, flags: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.flags = flags  # `resume_flags`, written into each checkpoint

    def train(self, *args: Any, **kwargs: Any) -> Any:
        # An evaluation before training (finetune's "before" scores) prepares the bare model for
        # evaluation, which Accelerate marks as prepared: the training's `prepare` then returned it as it
        # was, without DistributedDataParallel, and each process trained a copy of its own on its share of
        # the batches (the main process's, on half the data, was saved; the others' evaluations used
        # theirs). The evaluation's preparation is undone here, so the training wraps the model.
        model = self.model
        if (
            self.args.world_size > 1
            and self.model_wrapped is model
            and not (self.is_fsdp_enabled or self.is_deepspeed_enabled)  # prepared there as for training
            and getattr(model, "_is_accelerate_prepared", False)
        ):
            for name in ("_is_accelerate_prepared", "forward", "_original_forward"):  # autocast's forward
                model.__dict__.pop(name, None)
            self.accelerator._models = [m for m in self.accelerator._models if m is not model]
        return super().train(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        # A checkpoint's weights (`_save_checkpoint` saves them first): its flags go with them, before its
        # trainer_state.json makes it whole (`complete_checkpoints`). Written after that (Trainer's
        # `on_save`, which also follows the old checkpoints' deletion), a kill in between left a whole
        # checkpoint that recorded no flags, and a resume with others went unchecked.
        folder = Path(output_dir) if output_dir is not None else None
        if (
            self.flags is not None
            and _internal_call
            and folder is not None
            and folder.name == f"checkpoint-{self.state.global_step}"
            and self.is_world_process_zero()
            and folder.is_dir()
        ):
            with replaced_when_complete(folder / FLAGS_FILE) as stream:
                json.dump(self.flags, stream, indent=2)

    def _get_eval_sampler(self, eval_dataset: Any) -> torch.utils.data.Sampler | None:
        # transformers 5 also groups evaluation batches by length where training does
        # (`train_sampling_strategy="group_by_length"`): the outputs came back in another order than the
        # split's, `BleuMetric` never recognised its references, and scored against the labels decoded.
        # Several processes: Accelerate shards these batches and gathers them back in this order.
        return SequentialSampler(eval_dataset) if has_length(eval_dataset) else None

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        # Seq2SeqTrainer.evaluate gathers the processes' outputs with `accelerator.gather`, which keeps the
        # pairs Accelerate repeats to give every process as many batches: 21 pairs on 2 processes in
        # batches of 8 were scored as 32 (BLEU, chrF and the loss counted 11 pairs twice).
        # `gather_for_metrics` drops them.
        self.gather_function = self.accelerator.gather_for_metrics
        self._loss_sums = torch.zeros(2, dtype=torch.float64, device=self.args.device)  # loss, tokens
        output = super().evaluation_loop(
            dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
        )
        # Trainer's loss is the mean of its batches' means, the last (short) batch weighted as a full
        # one, and the batch filled up with repeated pairs keeps their losses in its mean
        # (`gather_for_metrics` drops the repeated outputs, not their share of a loss): the loss changed
        # with the process count. Here it is the loss per target token of the pairs evaluated, each once.
        loss, tokens = self.accelerator.reduce(self._loss_sums, "sum").tolist()
        if f"{metric_key_prefix}_loss" in output.metrics and tokens:
            output.metrics[f"{metric_key_prefix}_loss"] = loss / tokens
        return output

    def prediction_step(
        self,
        model: Any,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> Any:
        """Seq2SeqTrainer's, adding the loss and the target tokens of the batch's pairs that
        `gather_for_metrics` keeps to `_loss_sums`: on the last batch of several processes, the first
        pairs of each process's batch (all, some or none), the others repeated ones. (Only where the
        loss is the batch's token mean: with generation; Trainer's own path scales it across processes.)"""
        loss, generated, labels = super().prediction_step(
            model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs
        )
        generating = self.args.predict_with_generate and not prediction_loss_only
        if loss is None or "labels" not in inputs or not generating:
            return loss, generated, labels
        rows = len(inputs["labels"])
        mine = torch.full((rows,), self.accelerator.process_index, device=inputs["labels"].device)
        kept = int((self.accelerator.gather_for_metrics(mine) == self.accelerator.process_index).sum())
        tokens = int((inputs["labels"][:kept] != -100).sum())
        counted = loss
        if kept < rows and tokens:  # the kept pairs' loss alone, as Seq2SeqTrainer computes a batch's
            some = {name: value[:kept] if torch.is_tensor(value) else value for name, value in inputs.items()}
            with torch.no_grad(), self.compute_loss_context_manager():
                outputs = model(**some)
            smoother = self.label_smoother
            counted = smoother(outputs, some["labels"]) if smoother is not None else outputs["loss"]
        if tokens:
            counted = counted.detach().double().mean()
            self._loss_sums += torch.stack([counted * tokens, counted.new_tensor(tokens)]).to(self._loss_sums)
        return loss, generated, labels


def freeze_unsaved_parameters(model: torch.nn.Module) -> None:
    """Stop training the parameters that `save_pretrained` leaves out (`_keys_to_ignore_on_save`).
    transformers 5 loads a MarianMTModel's fixed sinusoidal position tables as
    trainable (a new one has them frozen): Trainer trained them, the saved folder lost them, and the
    scores printed after fine-tuning described another model than the one written."""
    patterns = getattr(model, "_keys_to_ignore_on_save", None) or []
    for name, parameter in model.named_parameters():
        if any(re.search(pattern, name) for pattern in patterns):
            parameter.requires_grad_(False)


def build_trainer(config: FinetuneConfig, **argument_overrides: Any) -> Seq2SeqTrainer:
    """The `Seq2SeqTrainer` for `config`; `argument_overrides` go to `Seq2SeqTrainingArguments`."""
    problem = None if argument_overrides.get("use_cpu") else processes_without_a_gpu()
    if problem:
        raise ValueError(problem)
    if alone := one_process_of_several():
        logger.warning(alone)
    # The data files' paths first: a missing one is said before the model is loaded (or downloaded)
    files = {"train": config.train_file, "validation": config.validation_file}
    check_data_paths({split: path for split, path in files.items() if path})
    # On the CPU: the trainer places it
    model, tokenizer = load_model_folder(config.model, "cpu", config.trust_remote_code)
    stored = {parameter.dtype for parameter in model.parameters() if parameter.is_floating_point()}
    if stored - {torch.float32, torch.float64}:
        # Trainer's Adam on float16 weights (no float32 copy) turned the model into garbage in 10 steps,
        # on bfloat16 ones lost most updates below the weights' rounding step; both ended with exit 0.
        logger.warning(
            f"{config.model} holds {', '.join(sorted(str(dtype) for dtype in stored))} weights: fine-tuned "
            "in float32 (Adam's updates are below half precision's resolution) and saved in float32."
        )
        model.float()
    freeze_unsaved_parameters(model)
    # One knob: this package's model computes its own label-smoothed loss (the fast path, no (N, V)
    # logits kept) with the fine-tuning's factor, and Trainer's smoother, which would need the logits,
    # stays off. Other models (a MarianMTModel folder) ignore that field: Trainer smooths for them.
    own_loss = model.config.model_type == VanillaTransformerConfig.model_type
    if own_loss:
        if model.config.label_smoothing != config.label_smoothing_factor:  # the default (0.1) included
            logger.warning(
                f"Fine-tuning with label smoothing {config.label_smoothing_factor:g} "
                f"(--label_smoothing_factor), where {config.model} was trained with "
                f"{model.config.label_smoothing:g}; the fine-tuned model records "
                f"{config.label_smoothing_factor:g}. Pass --label_smoothing_factor "
                f"{model.config.label_smoothing:g} to keep the model's."
            )
        model.config.label_smoothing = config.label_smoothing_factor
        if config.unlikelihood_weight is not None:
            model.config.unlikelihood_weight = config.unlikelihood_weight
    elif config.unlikelihood_weight:
        raise ValueError(
            f"--unlikelihood_weight applies to this package's models only; {config.model} is a "
            f"{model.config.model_type} model, whose loss Trainer computes."
        )
    data, report = load_parallel_data(
        train_file=config.train_file,
        validation_file=config.validation_file,
        source_lang=config.source_lang,
        target_lang=config.target_lang,
        source_column=config.source_column,
        target_column=config.target_column,
        validation_size=config.validation_size,
        seed=config.seed,
    )
    tokenized = tokenize_parallel_data(data, tokenizer, config.max_length, report)
    for line in report.lines():  # as the training script does: no pair leaves without a word
        logger.warning(line)
    # The training pairs, recorded with the flags: a resume on an edited --train_file is refused.
    flags = resume_flags(config) | {
        "train_pairs": len(tokenized["train"]),
        "train_sha256": text_digest(tokenized["train"]),
    }
    if report.validation_held_out:
        flags["validation_draw"] = "by source sentence"
    if (checkpoint := config.checkpoint_to_resume()) is not None:
        check_training_data(checkpoint, flags, config.train_file)
    columns = ["input_ids", "attention_mask", "labels"]
    validation = tokenized["validation"]
    if config.max_eval_samples is not None:
        validation = validation.select(range(min(config.max_eval_samples, len(validation))))

    # Several processes without GPUs (`CUDA_VISIBLE_DEVICES= accelerate launch --multi_gpu ...`, torchrun on
    # a CPU machine): Trainer sets up data parallelism over gloo only when told that it runs on CPUs;
    # otherwise every process trained a copy of its own on all the data and wrote the same files.
    # Only there: on an Intel XPU, Ascend NPU or Gaudi machine, use_cpu moved the processes off them.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not distributed_accelerator():
        argument_overrides.setdefault("use_cpu", True)
    if training_leaves_mps() and "use_cpu" not in argument_overrides:
        logger.warning("Fine-tuning runs on the CPU, not on Apple's MPS device: it has no float64 for sums.")
        argument_overrides["use_cpu"] = True
    arguments = Seq2SeqTrainingArguments(
        output_dir=config.output_dir,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        warmup_steps=config.warmup_steps,
        lr_scheduler_type="inverse_sqrt",
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-9,
        per_device_train_batch_size=config.per_device_train_batch_size,
        per_device_eval_batch_size=config.per_device_eval_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        label_smoothing_factor=0.0 if own_loss else config.label_smoothing_factor,
        eval_strategy="steps",
        eval_steps=config.eval_steps,
        save_strategy="steps",
        save_steps=config.eval_steps,
        save_total_limit=2,
        logging_steps=max(config.eval_steps // 5, 1),
        predict_with_generate=True,
        generation_num_beams=config.num_beams,
        train_sampling_strategy="group_by_length",
        length_column_name="source_length",
        report_to="none",
        seed=config.seed,
        **argument_overrides,
    )
    trainer = FinetuneTrainer(
        model=model,
        args=arguments,
        train_dataset=tokenized["train"].select_columns([*columns, "source_length"]),
        eval_dataset=validation.select_columns(columns),
        data_collator=seq2seq_collator(tokenizer, model),
        processing_class=tokenizer,
        compute_metrics=BleuMetric(
            tokenizer,
            validation.select_columns(["source", "target", "labels"]),
            len(tokenized["validation"]),
            target_lang=config.target_lang,
            decoder_start_token_id=decoder_start_id(model, {}),
        ),
        flags=flags,
    )
    if not own_loss and trainer.label_smoother is None:
        # --label_smoothing_factor 0: another model (MarianMTModel) averages its loss over its own
        # micro-batch and ignores Trainer's `num_items_in_batch`, while Trainer, since its forward takes
        # loss keywords, no longer divides by the accumulation steps: with gradient accumulation the loss
        # and gradient were that many times one large batch's. Trainer's smoother at 0 is plain cross
        # entropy over the whole update's tokens.
        trainer.label_smoother = LabelSmoother(epsilon=0.0)
    # Trainer takes the launcher's mixed precision (an `accelerate launch` config file, its flag, or
    # ACCELERATE_MIXED_PRECISION): fp16 it runs only off the CPU, where it trained in float32 and recorded
    # fp16; bf16 it runs, and the card says so (it said nothing).
    if trainer.accelerator.mixed_precision == "fp16" and trainer.args.device.type == "cpu":
        raise InputError(
            "Mixed precision fp16 (accelerate launch's) does not run on the CPU: Trainer would train in "
            "float32 and record fp16. Launch with --mixed_precision bf16 (bfloat16 autocast) or no."
        )
    return trainer


def checkpoint_folders(output: Path) -> dict[Path, int]:
    """`output`'s checkpoint-N folders, each with the latest modification time of its files (ns); a file
    removed meanwhile (the main process clearing an unfinished checkpoint) is left out."""

    def modified(path: Path) -> int:
        try:
            return path.stat().st_mtime_ns if path.is_file() else 0
        except FileNotFoundError:
            return 0

    def latest(folder: Path) -> int:
        try:
            return max((modified(f) for f in folder.rglob("*")), default=0)
        except FileNotFoundError:  # the folder itself, or one inside it, removed while read
            return 0

    return {folder: latest(folder) for folder in output.glob("checkpoint-*") if folder.is_dir()}


def checkpoint_write_error(
    error: Exception, config: FinetuneConfig, trainer: Seq2SeqTrainer, earlier: dict[Path, int]
) -> Exception:
    """What to raise when training failed with `error`: where Trainer was writing a checkpoint on a full
    disk (torch's writer says only "iostream error", safetensors' and tokenizers' errors are no
    OSErrors), an `InputError` saying so and naming the last whole checkpoint, the unfinished one
    removed (a resume skips it, but it holds the space); otherwise `error` itself. Only a checkpoint
    written in this training counts: not one of `earlier` (`checkpoint_folders` before it: one a killed
    run left) unless its files changed since (Trainer writes the same step's folder again)."""
    output = Path(config.output_dir)
    unfinished = [
        folder
        for folder, written in checkpoint_folders(output).items()
        if earlier.get(folder) != written and checkpoint_step(folder) is None
    ]
    if len(unfinished) != 1:  # Trainer writes one checkpoint at a time
        return error
    message = disk_full_message(
        error,
        unfinished[0],
        trainer.model,
        (
            f"The last whole checkpoint is {whole[0].name}: free some space (or move --output_dir) and "
            "resume with the same flags and --resume_from_checkpoint latest."
            if (whole := complete_checkpoints(output))
            else "No checkpoint was whole yet: free some space (or move --output_dir) and start again."
        ),
        what=f"checkpoint {unfinished[0].name} in {output}",
    )
    if message is None:
        return error
    if trainer.is_world_process_zero():
        for folder in unfinished:
            shutil.rmtree(folder, ignore_errors=True)
    return InputError(message)


def finetune(config: FinetuneConfig) -> dict[str, float]:
    """Evaluate, fine-tune, evaluate again and save; returns the metrics before and after. The folder of
    a model of this package gets its model card (`write_finetuned_card`), so it can be published."""
    checkpoint = config.checkpoint_to_resume()
    if config.resume_from_checkpoint == "latest":
        unfinished = [p for p in Path(config.output_dir).glob("checkpoint-*") if checkpoint_step(p) is None]
        if unfinished:
            names = ", ".join(sorted(p.name for p in unfinished))
            logger.warning(f"Skipping {names}: stopped while written. Resuming from {checkpoint}.")
    trainer = build_trainer(config)
    before = trainer.evaluate(metric_key_prefix="before")
    started = time.perf_counter()
    if checkpoint is not None and checkpoint_step(checkpoint) == config.max_steps:
        # Stopped after its last update (in the final evaluation or save): finish it. Trainer would
        # take one more update from there.
        trainer._load_from_checkpoint(str(checkpoint))
        trainer.state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    else:
        earlier = checkpoint_folders(Path(config.output_dir))
        try:
            trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
        except Exception as error:  # a full disk while Trainer writes a checkpoint: say so, and how to go on
            explained = checkpoint_write_error(error, config, trainer, earlier)
            if explained is error:
                raise
            raise explained from error
    seconds = time.perf_counter() - started
    after = trainer.evaluate(metric_key_prefix="after")
    own = trainer.model.config.model_type == VanillaTransformerConfig.model_type  # what the card describes
    try:
        trainer.save_model(config.output_dir)
        if trainer.is_world_process_zero() and own:
            write_finetuned_card(config, trainer, after, seconds)
    except Exception as error:  # safetensors' and tokenizers' errors are not OSErrors
        message = disk_full_message(
            error,
            config.output_dir,
            trainer.model,
            "The checkpoints are intact: free some space and run again with the same flags and "
            "--resume_from_checkpoint latest, which saves the model without training further.",
        )
        if message is None:
            raise
        raise InputError(message) from error
    if trainer.is_world_process_zero() and not own:
        logger.warning(
            f"No model card was written: {config.output_dir} holds a {type(trainer.model).__name__}, and "
            "the card describes this package's model. To publish it with push_to_hub.py, convert it "
            f"(`python scripts/convert_marian.py --model {config.output_dir} --output FOLDER --test_file "
            "PAIRS --source_lang ... --target_lang ...` scores it and writes the card), or publish it "
            "as it is with transformers' push_to_hub."
        )
    return before | after


def write_finetuned_card(
    config: FinetuneConfig, trainer: Seq2SeqTrainer, metrics: dict[str, float], seconds: float
) -> Path:
    """The model card of a fine-tuned model in `config.output_dir`: the model it started from, the
    fine-tuning's settings, data and time, and `metrics` (the last evaluation's, prefixed "after_"):
    BLEU and chrF on the validation split, decoded as the evaluation decoded."""
    model, args, metric = trainer.model, trainer.args, trainer.compute_metrics
    validation, scores = metric.references, metric.scores
    generation = model.generation_config
    local = Path(config.model).exists()
    if args.device.type == "cuda":
        hardware = f"{args.world_size} x {torch.cuda.get_device_name(args.device)}"
    else:
        processes = f", {args.world_size} processes" if args.world_size > 1 else ""
        hardware = format_machine(describe_machine(measure=False)) + processes
    settings = decoding_settings(generation)
    card_metrics = {
        "split": "validation",
        "dataset_name": Path(config.validation_file or config.train_file).name,
        "scored_pairs": len(validation),
        "split_pairs": metric.split_pairs,
        "bleu": metrics["after_bleu"],
        "chrf": metrics["after_chrf"],
        "bleu_signature": scores["bleu_signature"],
        "chrf_signature": scores["chrf_signature"],
        # The evaluation's beams; the rest is the model's generation config, and so is its default.
        **settings,
        "num_beams": config.num_beams,
        "default_num_beams": settings["num_beams"],
    }
    training = {
        "finetuned_from": Path(config.model).resolve().name if local else config.model,
        "finetuned_from_hub": not local,
        "steps": trainer.state.global_step,
        "epochs": round(trainer.state.epoch or 0.0, 2),
        "train_time_s": None if config.resume_from_checkpoint else round(seconds),  # only the resumed part
        "hardware": hardware,
        "batch_pairs": args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size,
        "warmup_steps": config.warmup_steps,
        "lr_peak": config.learning_rate,
        "label_smoothing": model.config.label_smoothing,
        "unlikelihood_weight": model.config.unlikelihood_weight,
        "dropout": model.config.dropout,
        "adam_beta1": args.adam_beta1,
        "adam_beta2": args.adam_beta2,
        "adam_epsilon": args.adam_epsilon,
        "max_grad_norm": args.max_grad_norm or None,
        "mixed_precision": None if (precision := trainer.accelerator.mixed_precision) == "no" else precision,
    }
    dataset = {
        "name": Path(config.train_file).name,
        "description": f"Local parallel text, {config.source_lang}-{config.target_lang}.",
        "train_pairs": len(trainer.train_dataset),  # the validation pairs scored: under Results
    }
    licence = base_license(config.model)
    copy_license_file(config.model, config.output_dir, licence["license_link"])
    return write_model_card(
        config.output_dir,
        model_name=Path(config.output_dir).resolve().name,
        config=model.config,
        metrics=card_metrics,
        training=training,
        dataset=dataset,
        source_lang=config.source_lang,
        target_lang=config.target_lang,
        **licence,
        examples=list(validation["source"][:3]),
    )


__all__ = [
    "BleuMetric",
    "FinetuneConfig",
    "FinetuneTrainer",
    "bleu_metric_fn",
    "build_trainer",
    "finetune",
    "write_finetuned_card",
]
