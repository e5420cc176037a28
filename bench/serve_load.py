"""Load generator for `doppler serve` (or any OpenAI-compatible server on this machine):
N concurrent streams of text completions, each request streamed, timed from the client.

Reports per concurrency level: aggregate generated tokens/s (all streams' tokens over the
level's wall time), time to first token p50/p99, time between tokens p50/p99, requests
finished. Bounded: --requests per level (default 2 x the concurrency), --max-tokens each,
--deadline seconds a level; only 127.0.0.1 / localhost URLs are accepted.

Uses only the standard library (http.client, threads), so it runs where the openai
package is not installed.

    python3 bench/serve_load.py --url http://127.0.0.1:8080 --model smollm2 \\
        --concurrency 1,8,32,64 --max-tokens 64 --json out.json
"""
import argparse
import http.client
import json
import multiprocessing
import statistics
import threading
import time
import urllib.parse


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


PREAMBLE = ("The lighthouse keeper kept a log of every ship that passed the rocks, "
            "the weather at dawn and dusk, and the colour of the sea. ")


def one(url, model, prompt, max_tokens, seed, key):
    """One streamed completion: (ttft_s, [gaps between tokens_s], tokens, ok)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.8, "seed": seed, "stream": True,
                       "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers=headers)
    r = conn.getresponse()
    if r.status != 200:
        r.read()
        conn.close()
        return None, [], 0, False
    first, last, gaps, tokens = None, None, [], 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        if ev.get("choices") and ev["choices"][0].get("text"):
            now = time.perf_counter()
            if first is None:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
    conn.close()
    return first, gaps, tokens, True


def streams(args, todo, n, barrier=None):
    """n threads taking requests from `todo` until it is empty or the deadline passes:
    (start, end, ttft list, gaps list, tokens, done, failed), times from perf_counter
    (CLOCK_MONOTONIC: comparable between processes)."""
    lock = threading.Lock()
    ttft, gaps, tokens, done, failed = [], [], 0, 0, 0
    if barrier is not None:
        barrier.wait()
    deadline = time.perf_counter() + args.deadline

    def worker():
        nonlocal tokens, done, failed
        while time.perf_counter() < deadline:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            prompt = args.prompt
            if args.preamble:
                # The same preamble for every request (a shared system prompt), then the
                # request's own words.
                prompt = PREAMBLE * args.preamble + f"Entry {i}: " + args.prompt
            f, g, t, ok = one(args.url, args.model, prompt, args.max_tokens, i, args.key)
            with lock:
                if ok:
                    done += 1
                    tokens += t
                    gaps.extend(g)
                    if f is not None:
                        ttft.append(f)
                else:
                    failed += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return t0, time.perf_counter(), ttft, gaps, tokens, done, failed


def in_process(args, todo, n, barrier, queue):
    queue.put(streams(args, todo, n, barrier))


def level(args, n):
    todo = list(range(args.requests or 2 * n))
    procs = max(1, min(args.processes, n))
    if procs == 1:
        parts = [streams(args, todo, n)]
    else:
        # The streams split over processes (one interpreter's lock would pace them all):
        # process j takes requests j, j + procs, ... with its share of the streams.
        ctx = multiprocessing.get_context("fork")
        barrier, queue = ctx.Barrier(procs), ctx.Queue()
        ps = [ctx.Process(target=in_process,
                          args=(args, todo[j::procs], n // procs + (j < n % procs), barrier, queue))
              for j in range(procs)]
        for p in ps:
            p.start()
        # (A process that died sends nothing: give up on it after the level's deadline.)
        parts = [queue.get(timeout=args.deadline + 60) for _ in ps]
        for p in ps:
            p.join()
    wall = max(p[1] for p in parts) - min(p[0] for p in parts)
    ttft = [x for p in parts for x in p[2]]
    gaps = [x for p in parts for x in p[3]]
    tokens, done, failed = (sum(p[i] for p in parts) for i in (4, 5, 6))
    ms = lambda x: None if x is None else round(x * 1e3, 2)
    return {"concurrency": n, "processes": procs, "requests": done, "failed": failed,
            "tokens": tokens, "wall_s": round(wall, 3),
            "tok_s": round(tokens / wall, 1) if wall else 0,
            "ttft_ms_p50": ms(pct(ttft, 50)), "ttft_ms_p99": ms(pct(ttft, 99)),
            "tbt_ms_p50": ms(pct(gaps, 50)), "tbt_ms_p99": ms(pct(gaps, 99)),
            "tbt_ms_mean": ms(statistics.fmean(gaps)) if gaps else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--key", default=None)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--requests", type=int, default=0, help="per level (0: 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Once upon a time, in a small village by the sea,")
    ap.add_argument("--preamble", type=int, default=0,
                    help="prefix every prompt with this many copies of a ~25-word sentence, "
                         "the same for all requests (a shared prefix), then its own words")
    ap.add_argument("--deadline", type=float, default=120, help="seconds a level, at most")
    ap.add_argument("--processes", type=int, default=1,
                    help="client processes the streams are split over (each a share of the "
                         "threads): one Python process can pace fast servers by itself")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    host = urllib.parse.urlparse(args.url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"serve_load: only a server on this machine (got {host})")
    if args.model is None:
        u = urllib.parse.urlparse(args.url)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
        h = {"Authorization": f"Bearer {args.key}"} if args.key else {}
        conn.request("GET", "/v1/models", headers=h)
        args.model = json.loads(conn.getresponse().read())["data"][0]["id"]
    out = []
    for n in [int(x) for x in args.concurrency.split(",")]:
        r = level(args, n)
        print(json.dumps(r), flush=True)
        out.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "max_tokens": args.max_tokens,
                       "preamble": args.preamble, "levels": out}, f, indent=1)


if __name__ == "__main__":
    main()
