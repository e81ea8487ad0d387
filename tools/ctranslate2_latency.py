"""Time a CTranslate2 export in a process that never imports torch (see `tools.benchmark.deployment`).

    python tools/ctranslate2_latency.py EXPORT_DIR SOURCES_JSON REPEATS

SOURCES_JSON maps "batch beams" to lists of token-id rows. For each setting the median seconds with one
intra-op thread and with one per core, the faster of the two, and the faster one's output ids (both decode
the same), as JSON.
(torch's OpenMP threads, once started, keep spinning and slow CTranslate2's own several-fold on a small
machine; and on some CPUs int8 runs faster on one thread than on two, so both are measured.)
"""

import json
import os
import statistics
import sys
import time

import ctranslate2


def latency(export_dir: str, sources: dict[str, list[list[int]]], repeats: int) -> dict[str, dict]:
    results = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        translator = ctranslate2.Translator(export_dir, intra_threads=threads)
        for key, rows in sources.items():
            beams, length = int(key.split()[1]), len(rows[0]) if rows else 0
            tokens = [[f"<{i}>" for i in row] for row in rows]
            options = {"beam_size": beams, "min_decoding_length": length, "max_decoding_length": length}

            def call(tokens=tokens, options=options, translator=translator):
                return translator.translate_batch(tokens, max_input_length=0, **options)

            # warm-up; the output's token names are read back as ids here only, outside the timed calls
            # (`generate()`'s timed calls return ids as they are)
            outputs = [[int(t[1:-1]) for t in result.hypotheses[0]] for result in call()]
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                call()
                times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            if key not in results or seconds < results[key]["seconds"]:
                results[key] = {"seconds": seconds, "threads": threads, "tokens": outputs}
    return results


if __name__ == "__main__":
    if len(sys.argv) != 4 or not sys.argv[3].isdigit():
        sys.exit(__doc__)
    export, sources_file, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(sources_file) as handle:
        print(json.dumps(latency(export, json.load(handle), repeats)))
