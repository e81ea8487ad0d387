"""How many training runs it takes to tell two recipes apart by their looping outputs.

Looping test outputs are rare events: the tiny recipe's default left 2 in 11 runs (issue 11's eleventh
round). Counted over n runs per recipe, the totals are Poisson with means n * rate_a and n * rate_b.
Given their sum, the count of recipe B is binomial with p = 1/2 if both recipes loop equally often, so
"B loops less" is shown at level alpha when that binomial's lower tail at B's count is <= alpha (the
conditional test for two Poisson rates). This prints, for each n, the probability of showing it when
B's rate really is `ratio` times A's (the power), and the chances that A and B have no looping output
at all in n runs. Exact sums over the Poisson probabilities, no simulation:

    python -m tools.loop_count_power --rate 0.182 --ratio 0.5 --runs 11 25 50 100 200
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence


def poisson_pmf(mean: float, count: int) -> float:
    """P(X = count) for X ~ Poisson(mean), computed in log space so that large counts do not overflow."""
    if mean == 0:
        return 1.0 if count == 0 else 0.0
    return math.exp(count * math.log(mean) - mean - math.lgamma(count + 1))


def binomial_lower_tail(successes: int, trials: int) -> float:
    """P(Y <= successes) for Y ~ Binomial(trials, 1/2)."""
    return sum(math.comb(trials, k) for k in range(successes + 1)) / 2**trials


def power(mean_a: float, mean_b: float, alpha: float = 0.05, tail: float = 1e-12) -> float:
    """Probability that the conditional test shows B's count lower than A's at level `alpha`, where A's and
    B's totals are Poisson with means `mean_a` and `mean_b`. Counts whose probabilities sum to less than
    `tail` are left out of the sum."""
    if min(mean_a, mean_b) < 0 or not 0 < alpha < 1:
        raise ValueError(f"means must be >= 0 and alpha in (0, 1), got {mean_a}, {mean_b}, {alpha}")

    def support(mean: float) -> range:
        count, total = 0, 0.0
        while total < 1 - tail:
            total += poisson_pmf(mean, count)
            count += 1
        return range(count)

    counts_b = support(mean_b)
    shown = 0.0
    for count_a in support(mean_a):
        p_a = poisson_pmf(mean_a, count_a)
        for count_b in counts_b:
            if binomial_lower_tail(count_b, count_a + count_b) <= alpha:
                shown += p_a * poisson_pmf(mean_b, count_b)
    return shown


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2 / 11, help="recipe A's looping outputs per run")
    parser.add_argument("--ratio", type=float, default=0.5, help="recipe B's rate as a share of A's")
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--runs", type=int, nargs="+", default=[11, 25, 50, 100, 200])
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.ratio < 0 or not 0 < args.alpha < 1 or any(n < 1 for n in args.runs):
        parser.error("--rate must be > 0, --ratio >= 0, --alpha in (0, 1) and every --runs value >= 1")
    print(f"A loops {args.rate:.3f} times per run, B {args.ratio:g} times as often; alpha {args.alpha}")
    print("| runs per recipe | power | P(A loop-free in all runs) | P(B loop-free in all runs) |")
    print("|---|---|---|---|")
    for runs in args.runs:
        mean_a, mean_b = args.rate * runs, args.rate * args.ratio * runs
        shown = power(mean_a, mean_b, args.alpha)
        print(f"| {runs} | {shown:.2f} | {math.exp(-mean_a):.2f} | {math.exp(-mean_b):.2f} |")


if __name__ == "__main__":
    main()
