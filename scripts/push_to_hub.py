"""Publish a trained model folder to the Hugging Face Hub (weights, config, code, tokenizer, card).

    python scripts/push_to_hub.py --folder outputs/tiny-en-es --repo_id your-name/transformer-tiny-en-es

The token comes from --token, HF_TOKEN or `hf auth login`. The folder is checked first: a missing
file, an invalid repo id or a missing token stop with a message before anything is uploaded.
"""

import argparse
import sys

from vanilla_transformer.cli import first_line, utf8_stdout
from vanilla_transformer.hub import push_model_folder

utf8_stdout()  # what is printed, in UTF-8 whatever the locale

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--folder", required=True, help="model folder written by scripts/train.py")
parser.add_argument("--repo_id", required=True, help="namespace/name on the Hub")
parser.add_argument("--token", help="default: HF_TOKEN or the token saved by `hf auth login`")
parser.add_argument(
    "--private",
    action=argparse.BooleanOptionalAction,
    help="create the repo private (--no-private: public; default: the namespace's default)",
)
parser.add_argument("--commit_message", default="Upload vanilla_transformer model")
parser.add_argument(
    "--keep_other_files",
    action="store_true",
    help="leave files of the repo that the folder does not have (default: delete them in the same commit; "
    "they stay in the repo's history)",
)
parser.add_argument(
    "--include_other_files",
    action="store_true",
    help="also upload files that are not a model folder's (notes, data, subfolders; default: refuse them)",
)
args = parser.parse_args()
try:
    url = push_model_folder(
        args.folder,
        args.repo_id,
        token=args.token,
        private=args.private,
        commit_message=args.commit_message,
        delete_other_files=not args.keep_other_files,
        include_other_files=args.include_other_files,
    )
except (OSError, ValueError) as error:  # the folder, the repo id, the token; the Hub's HTTP answers
    parser.error(str(error))
except Exception as error:  # the Hub not reached: the HTTP client's own errors, which are neither
    sys.exit(f"error: publishing to the Hub failed: {type(error).__name__}: {first_line(error)}")
except KeyboardInterrupt:  # Ctrl-C: stop as command-line tools do, saying what the repo holds
    print(
        "interrupted: the upload is one commit, made at its end, so the repo holds none of it unless that "
        "commit had been sent (the repo may have been created); run the command again to publish",
        file=sys.stderr,
    )
    sys.exit(130)
print(f"uploaded: {url}")
