"""Time to first token of a conversation's second turn, with and without the prompt cache.

Starts `cortiq serve` twice (default cache, then `--cache-mb 0`), and for each of R rounds
sends a long first turn (about N prompt tokens, greedy, 32 reply tokens) and then the second
turn (the first turn, its reply, a short new message), streamed; the time from sending the
second turn to its first text is its time to first token. Every round's first message is
different, so nothing carries over between rounds.

    python tools/serve-bench/ttft.py --cortiq target/release/cortiq [--model M.cmf]
        [--tokens 2000] [--rounds 3] [-- extra serve args, e.g. --backend wgpu]

Standard library only (it runs on machines without the client packages). Prints one line
per configuration (medians).
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

PASSAGE = (
    "Now is the winter of our discontent made glorious summer by this sun of York; and all "
    "the clouds that lour'd upon our house in the deep bosom of the ocean buried. "
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args, extra):
    port = free_port()
    cmd = [args.cortiq, "serve", "--port", str(port), "-c", str(args.tokens + 512)]
    if args.model:
        cmd.append(args.model)
    proc = subprocess.Popen(cmd + extra, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health").read()
            return proc, url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not start")


def first_text(url, messages):
    """Streams a greedy reply; returns (seconds to first text, whole text, cached tokens)."""
    body = json.dumps(
        {
            "messages": messages,
            "temperature": 0,
            "max_tokens": 32,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft, text, cached = None, "", 0
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return (ttft if ttft is not None else time.perf_counter() - t0), text, cached


def run(args, label, extra):
    proc, client = serve(args, extra)  # client: the server's URL
    try:
        first, second, cached = [], [], []
        words = args.tokens // 2  # the passage is about 2 tokens a word or less
        long = (PASSAGE * (words // len(PASSAGE.split()) + 1)).split()[:words]
        for r in range(args.rounds):
            msgs = [{"role": "user", "content": f"Round {r}. " + " ".join(long)}]
            t1, reply, _ = first_text(client, msgs)
            msgs += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "And then?"},
            ]
            t2, _, c = first_text(client, msgs)
            first.append(t1)
            second.append(t2)
            cached.append(c)
        print(
            f"{label}: first turn {statistics.median(first) * 1e3:.0f} ms to first token, "
            f"second turn {statistics.median(second) * 1e3:.0f} ms "
            f"(cached prompt tokens {cached})"
        )
    finally:
        proc.terminate()
        proc.wait()


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser()
    p.add_argument("--cortiq", required=True)
    p.add_argument("--model")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    run(args, "prompt cache on", extra)
    run(args, "prompt cache off", extra + ["--cache-mb", "0"])


if __name__ == "__main__":
    main()
