"""The online softmax of L3's C++ kernel, worked by hand: one query, two pages of two keys each.

    python scripts/l3_online_softmax.py

The kernel sees a request's keys a page at a time and never holds all its scores at once. Per page it
prints: the page's scores and their max; if that max is above the running one, the factor the running sum
and accumulator shrink by, exp(old max - new max); the page's weights exp(score - max); the state after
the page. Then accumulator / sum beside softmax(all scores) @ V in one pass, and two broken loops on the same
pages: exercise 5's bug, the one tests/test_l3_cpp_backend.py plants and catches (the accumulator is not
shrunk, the sum still is: the line `scale_by(acc, shrink, d);` deleted), and the loop with neither shrunk.
"""
from __future__ import annotations

import argparse
import math

# (scores q.k / sqrt(D), values) of each page. One value per key (D = 1) keeps the arithmetic readable.
PAGES = [([1.0, 2.0], [10.0, 20.0]), ([4.0, 3.0], [30.0, 40.0])]


def online(pages: list[tuple[list[float], list[float]]], shrink_sum: bool = True, shrink_acc: bool = True,
           show: bool = False) -> float:
    """The kernel's loop for one lane (paged_attention.cpp, softmax_page), in plain Python. `shrink_acc=False`
    is exercise 5's bug; `shrink_sum=False` as well skips both."""
    m, total, acc = -math.inf, 0.0, 0.0  # running max, running sum of weights, running sum of weight x value
    for p, (scores, values) in enumerate(pages):
        page_max = max(scores)
        line = f"page {p}: scores {scores}, max {page_max:g}"
        if page_max > m:
            shrink = math.exp(m - page_max)  # exp(-inf) = 0 on the first page, where sum and acc are 0 anyway
            line += f" > running max {m:g}: sum and acc shrink by exp({m:g} - {page_max:g}) = {shrink:.4f}"
            total *= shrink if shrink_sum else 1.0
            acc *= shrink if shrink_acc else 1.0
            m = page_max
        weights = [math.exp(s - m) for s in scores]
        total += sum(weights)
        acc += sum(w * v for w, v in zip(weights, values))
        if show:
            print(line)
            print(f"        weights exp(score - {m:g}) = [{', '.join(f'{w:.4f}' for w in weights)}], "
                  f"values {values}: sum {total:.4f}, acc {acc:.4f}")
    return acc / total


def one_pass(pages: list[tuple[list[float], list[float]]]) -> float:
    scores = [s for page, _ in pages for s in page]
    values = [v for _, page in pages for v in page]
    weights = [math.exp(s - max(scores)) for s in scores]
    return sum(w * v for w, v in zip(weights, values)) / sum(weights)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    out = online(PAGES, show=True)
    print(f"output: acc / sum = {out:.4f}")
    print(f"one pass over all four scores: softmax @ V = {one_pass(PAGES):.4f}")
    largest = max(v for _, values in PAGES for v in values)
    stale = math.exp(2)  # page 0's weights were taken against its max 2; page 1 raised the max to 4
    print(f"exercise 5's bug (acc not shrunk, sum shrunk): {online(PAGES, shrink_acc=False):.4f}, above every value "
          f"(the largest is {largest:g})")
    print(f"neither shrunk: {online(PAGES, shrink_sum=False, shrink_acc=False):.4f}, a weighted mean, but page 0's "
          f"weights e^2 = {stale:.2f}x too large")

if __name__ == "__main__":
    main()
