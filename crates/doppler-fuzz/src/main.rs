//! `doppler-fuzz`: a structured mutational fuzzer for Doppler's parsers that runs on stable
//! Rust (no cargo-fuzz, no nightly).
//!
//! Each target (src/targets.rs) starts from a seed corpus (`fuzz/corpus/<target>/`, written
//! by `doppler-fuzz seeds`) and runs inputs derived from it: one to eight mutations of a
//! corpus entry (bit flips, boundary integers written over 1, 2, 4 or 8 bytes, numbers in
//! text swapped for boundary values, the format's own tokens spliced in, ranges deleted,
//! duplicated or cut off, two entries spliced). Inputs a target accepts join the corpus
//! (up to 512), so mutations reach past the first checks. Run n of seed s is a pure
//! function of (s, n, the corpus): `doppler-fuzz replay` writes it again.
//!
//! A finding: a panic (caught and reported with its input saved under `fuzz/crashes/`), an
//! abort, an allocation of more than 1 GiB (the process stops, naming the run), or an input
//! that takes more than 2 s. The exit status is 1 when anything was found.

mod targets;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use doppler::check::Rng;
use targets::{Target, TARGETS};

/// Largest single allocation a parser may ask for.
const ALLOC_LIMIT: usize = 1 << 30;
/// Longest an input may take.
const SLOW: Duration = Duration::from_secs(2);
/// Most inputs kept in a target's corpus.
const CORPUS_MAX: usize = 512;
/// Longest input the mutator makes.
const MAX_LEN: usize = 1 << 20;

/// The run in progress, for the allocator's message.
static RUN: AtomicU64 = AtomicU64::new(u64::MAX);

/// The system allocator, refusing (and naming the run of) any allocation past ALLOC_LIMIT:
/// a parser that trusts a size in its input asks for gigabytes before it reads them.
struct Limited;

unsafe impl GlobalAlloc for Limited {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > ALLOC_LIMIT {
            report_oversize(layout.size());
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_LIMIT {
            report_oversize(new_size);
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Limited = Limited;

/// Writes "allocation of N bytes at run R" to stderr without allocating.
fn report_oversize(size: usize) {
    fn digits(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
        let mut i = buf.len();
        loop {
            i -= 1;
            buf[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                return &buf[i..];
            }
        }
    }
    let (mut a, mut b) = ([0u8; 20], [0u8; 20]);
    let mut e = std::io::stderr().lock();
    let _ = e.write_all(b"\nFINDING: an allocation of ");
    let _ = e.write_all(digits(size as u64, &mut a));
    let _ = e.write_all(b" bytes (limit 1 GiB) at run ");
    let _ = e.write_all(digits(RUN.load(Ordering::Relaxed), &mut b));
    let _ = e.write_all(b"; `doppler-fuzz replay` writes that input\n");
}

#[derive(Parser)]
#[command(
    name = "doppler-fuzz",
    about = "Fuzz Doppler's parsers (GGUF, SafeTensors, tokenizer.json and chat templates, training configs)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fuzz the named targets (all when none is named).
    Run {
        targets: Vec<String>,
        /// Seconds a target.
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// Stop a target after this many runs (whichever comes first).
        #[arg(long)]
        runs: Option<u64>,
        /// Seed of the mutations.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The seed corpus (one folder a target).
        #[arg(long, default_value = "fuzz/corpus")]
        corpus: PathBuf,
        /// Where inputs that crashed are saved.
        #[arg(long, default_value = "fuzz/crashes")]
        crashes: PathBuf,
        /// One JSON line a target on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Write the input of one run (as `run` would make it) to a file.
    Replay {
        target: String,
        #[arg(long)]
        run: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value = "fuzz/corpus")]
        corpus: PathBuf,
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Run one input file through a target.
    Check { target: String, file: PathBuf },
    /// (Re)write the seed corpus from Doppler's tiny test models and the configs.
    Seeds {
        #[arg(long, default_value = "fuzz/corpus")]
        corpus: PathBuf,
    },
    /// List the targets.
    List,
}

fn target(name: &str) -> Result<&'static Target, String> {
    TARGETS.iter().find(|t| t.name == name).ok_or_else(|| {
        let all: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
        format!("no target {name:?}; the targets: {}", all.join(", "))
    })
}

fn load_corpus(dir: &Path, t: &Target) -> Result<Vec<Vec<u8>>, String> {
    let d = dir.join(t.name);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&d)
        .map_err(|e| format!("{}: {e} (write it with `doppler-fuzz seeds`)", d.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let corpus: Vec<Vec<u8>> = files.iter().filter_map(|p| std::fs::read(p).ok()).collect();
    if corpus.is_empty() {
        return Err(format!("{}: no seed inputs", d.display()));
    }
    Ok(corpus)
}

const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    7,
    8,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
    u64::MAX - 1,
    1 << 40,
    1 << 62,
];
const NUMBERS: &[&str] = &[
    "0",
    "-1",
    "1",
    "-0",
    "2",
    "3",
    "255",
    "65536",
    "4294967295",
    "4294967296",
    "-2147483649",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "1e308",
    "1e-320",
    "nan",
    "inf",
    "-inf",
    "0.5",
    "1000000000",
];

/// One mutation of `data` in place.
fn mutate(rng: &mut Rng, data: &mut Vec<u8>, corpus: &[Vec<u8>], dict: &[&[u8]]) {
    let mut pick = |n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
    let len = data.len();
    match pick(10) {
        0 if len > 0 => {
            let i = pick(len);
            data[i] ^= 1 << pick(8);
        }
        1 if len > 0 => {
            let i = pick(len);
            data[i] = [0u8, 1, 0x7f, 0x80, 0xff, b'"', b'\\', b'{'][pick(8)];
        }
        2 if len > 0 => {
            // A boundary integer over 1, 2, 4 or 8 bytes (little-endian), or near the value.
            let w = [1usize, 2, 4, 8][pick(4)].min(len);
            let i = pick(len - w + 1);
            let mut v = INTERESTING[pick(INTERESTING.len())];
            if pick(4) == 0 {
                let mut cur = [0u8; 8];
                cur[..w].copy_from_slice(&data[i..i + w]);
                v = u64::from_le_bytes(cur).wrapping_add([1, u64::MAX, 2, 16][pick(4)]);
            }
            data[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
        }
        3 if len > 0 => {
            // A run of digits (a number in text) swapped for a boundary value.
            let i = pick(len);
            if let Some(s) = (i..len).find(|&j| data[j].is_ascii_digit()) {
                let e = (s..len)
                    .find(|&j| !data[j].is_ascii_digit() && data[j] != b'.')
                    .unwrap_or(len);
                let s = (0..s).rev().find(|&j| data[j] != b'-').map_or(0, |j| j + 1);
                let n = NUMBERS[pick(NUMBERS.len())].as_bytes();
                data.splice(s..e, n.iter().copied());
            }
        }
        4 if !dict.is_empty() => {
            let tok = dict[pick(dict.len())];
            let i = pick(len + 1);
            if pick(2) == 0 || len == 0 {
                data.splice(i..i, tok.iter().copied());
            } else {
                let e = (i + tok.len()).min(len);
                data.splice(i..e, tok.iter().copied());
            }
        }
        5 if len > 0 => {
            let i = pick(len);
            let n = 1 + pick((len - i).min(64));
            data.drain(i..i + n);
        }
        6 if len > 0 => {
            let i = pick(len);
            let n = 1 + pick((len - i).min(256));
            let chunk = data[i..i + n].to_vec();
            let at = pick(len + 1);
            data.splice(at..at, chunk);
        }
        7 if len > 0 => data.truncate(pick(len)),
        8 => {
            // Splice: the head of this input, the tail of another.
            let other = &corpus[pick(corpus.len())];
            let (i, j) = (pick(len + 1), pick(other.len() + 1));
            data.truncate(i);
            data.extend_from_slice(&other[j..]);
        }
        _ if len > 0 => {
            // A line or a byte range repeated many times (deep nesting, long strings).
            let i = pick(len);
            let n = 1 + pick((len - i).min(8));
            let chunk = data[i..i + n].to_vec();
            let times = 1 + pick(200);
            let at = pick(len + 1);
            data.splice(at..at, chunk.repeat(times));
        }
        _ => data.push(pick(256) as u8),
    }
    data.truncate(MAX_LEN);
}

/// The input of run `n` from the corpus as it stands.
fn input(seed: u64, n: u64, corpus: &[Vec<u8>], dict: &[&[u8]]) -> Vec<u8> {
    let mut rng = Rng::new(seed ^ n.wrapping_mul(0xA24B_AED4_963E_E407));
    let mut data = corpus[(rng.next_u64() % corpus.len() as u64) as usize].clone();
    let k = 1 + rng.next_u64() % 8;
    for _ in 0..k {
        mutate(&mut rng, &mut data, corpus, dict);
    }
    data
}

thread_local! {
    static PANIC: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Runs one input; Some(message) when it panicked.
fn exec(t: &Target, data: &[u8]) -> (Option<String>, bool) {
    let r = std::panic::catch_unwind(|| (t.run)(data));
    match r {
        Ok(out) => (None, out.is_ok()),
        Err(_) => (
            Some(
                PANIC
                    .with(|p| p.borrow_mut().take())
                    .unwrap_or_else(|| "panic".into()),
            ),
            false,
        ),
    }
}

struct Report {
    target: &'static str,
    runs: u64,
    seconds: f64,
    accepted: u64,
    corpus: usize,
    findings: Vec<String>,
}

fn fuzz(
    t: &'static Target,
    seconds: f64,
    max_runs: Option<u64>,
    seed: u64,
    corpus_dir: &Path,
    crashes: &Path,
) -> Result<Report, String> {
    let mut corpus = load_corpus(corpus_dir, t)?;
    let mut findings = Vec::new();
    // The seeds themselves first.
    for (i, s) in corpus.clone().iter().enumerate() {
        if let (Some(p), _) = exec(t, s) {
            findings.push(format!("seed {i} panicked: {p}"));
        }
    }
    let t0 = Instant::now();
    let (mut n, mut accepted) = (0u64, 0u64);
    let mut last_note = Instant::now();
    while t0.elapsed().as_secs_f64() < seconds
        && max_runs.is_none_or(|m| n < m)
        && findings.len() < 10
    {
        let data = input(seed, n, &corpus, t.dict);
        RUN.store(n, Ordering::Relaxed);
        let start = Instant::now();
        let (panicked, ok) = exec(t, &data);
        let took = start.elapsed();
        if panicked.is_some() || took > SLOW {
            std::fs::create_dir_all(crashes).map_err(|e| format!("{}: {e}", crashes.display()))?;
            let path = crashes.join(format!("{}-seed{seed}-run{n}", t.name));
            std::fs::write(&path, &data).map_err(|e| format!("{}: {e}", path.display()))?;
            let what = match panicked {
                Some(p) => format!("panicked: {p}"),
                None => format!("took {:.1} s", took.as_secs_f64()),
            };
            eprintln!(
                "FINDING: {} run {n} {what} (input saved to {})",
                t.name,
                path.display()
            );
            findings.push(format!("run {n} {what} ({})", path.display()));
        }
        if ok {
            accepted += 1;
            if corpus.len() < CORPUS_MAX && !corpus.contains(&data) {
                corpus.push(data);
            }
        }
        n += 1;
        if last_note.elapsed() > Duration::from_secs(15) {
            eprintln!(
                "  {}: {n} runs, {accepted} accepted, corpus {}",
                t.name,
                corpus.len()
            );
            last_note = Instant::now();
        }
    }
    Ok(Report {
        target: t.name,
        runs: n,
        seconds: t0.elapsed().as_secs_f64(),
        accepted,
        corpus: corpus.len(),
        findings,
    })
}

fn main() -> std::process::ExitCode {
    std::panic::set_hook(Box::new(|info| {
        let msg = format!("{info}");
        PANIC.with(|p| *p.borrow_mut() = Some(msg));
    }));
    match run(Cli::parse()) {
        Ok(clean) => std::process::ExitCode::from(if clean { 0 } else { 1 }),
        Err(e) => {
            eprintln!("doppler-fuzz: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<bool, String> {
    match cli.cmd {
        Cmd::List => {
            for t in TARGETS {
                println!("{:<12} {}", t.name, t.about);
            }
            Ok(true)
        }
        Cmd::Seeds { corpus } => {
            seeds::write(&corpus)?;
            Ok(true)
        }
        Cmd::Check { target: name, file } => {
            let t = target(&name)?;
            let data = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            let (p, ok) = exec(t, &data);
            match p {
                Some(p) => {
                    println!("panicked: {p}");
                    Ok(false)
                }
                None => {
                    println!("{}", if ok { "accepted" } else { "refused" });
                    Ok(true)
                }
            }
        }
        Cmd::Replay {
            target: name,
            run,
            seed,
            corpus,
            output,
        } => {
            // The corpus grows as inputs are accepted: replay the runs before this one.
            let t = target(&name)?;
            let mut c = load_corpus(&corpus, t)?;
            for n in 0..run {
                let data = input(seed, n, &c, t.dict);
                if let (None, true) = exec(t, &data) {
                    if c.len() < CORPUS_MAX && !c.contains(&data) {
                        c.push(data);
                    }
                }
            }
            let data = input(seed, run, &c, t.dict);
            std::fs::write(&output, &data).map_err(|e| format!("{}: {e}", output.display()))?;
            eprintln!(
                "run {run} of {name} (seed {seed}): {} bytes written to {}",
                data.len(),
                output.display()
            );
            Ok(true)
        }
        Cmd::Run {
            targets,
            seconds,
            runs,
            seed,
            corpus,
            crashes,
            json,
        } => {
            let chosen: Vec<&'static Target> = if targets.is_empty() {
                TARGETS.iter().collect()
            } else {
                targets
                    .iter()
                    .map(|n| target(n))
                    .collect::<Result<_, _>>()?
            };
            let mut clean = true;
            for t in chosen {
                let r = fuzz(t, seconds, runs, seed, &corpus, &crashes)?;
                clean &= r.findings.is_empty();
                if json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "target": r.target, "runs": r.runs, "seconds": r.seconds,
                            "runs_per_s": r.runs as f64 / r.seconds, "accepted": r.accepted,
                            "corpus": r.corpus, "findings": r.findings, "seed": seed,
                        })
                    );
                } else {
                    println!(
                        "{:<12} {:>10} runs in {:>6.1} s ({:>8.0}/s), {:>8} accepted, corpus {:>3}, {} findings",
                        r.target, r.runs, r.seconds, r.runs as f64 / r.seconds, r.accepted, r.corpus, r.findings.len()
                    );
                    for f in &r.findings {
                        println!("  {f}");
                    }
                }
            }
            Ok(clean)
        }
    }
}

mod seeds;
