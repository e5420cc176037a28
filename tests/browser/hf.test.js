// A Hugging Face directory in the browser: a tiny random Llama written here (config.json,
// a byte-level BPE tokenizer.json, tokenizer_config.json, model.safetensors), loaded from
// `File`s read a tensor at a time; greedy ids equal the native CLI's on the same
// directory. Then bad directories: no tokenizer.json, a corrupt SafeTensors header, a
// tensor cut short; each a clear rejection, and no GPU memory left behind.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { api, dopplerBin, REPO, withBrowser } from './helpers.js';

const CFG = {
  model_type: 'llama', hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
  num_key_value_heads: 2, intermediate_size: 128, vocab_size: 259, rms_norm_eps: 1e-5,
  rope_theta: 10000.0, max_position_embeddings: 64, tie_word_embeddings: true,
};
const PROMPT = 'hello there';
const TOKENS = 8;

// GPT-2's byte-to-character map: the byte-level BPE vocabulary's 256 base pieces.
function byteChars() {
  const bs = [];
  for (let b = 0x21; b <= 0x7e; b++) bs.push(b);
  for (let b = 0xa1; b <= 0xac; b++) bs.push(b);
  for (let b = 0xae; b <= 0xff; b++) bs.push(b);
  const cs = [...bs];
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bs.includes(b)) { bs.push(b); cs.push(256 + n); n++; }
  }
  const out = new Array(256);
  bs.forEach((b, i) => { out[b] = String.fromCodePoint(cs[i]); });
  return out;
}

function tokenizerJson() {
  const vocab = {};
  byteChars().forEach((c, i) => { vocab[c] = i; });
  vocab.he = 256;
  const special = (id, content) => ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
  return JSON.stringify({
    version: '1.0', truncation: null, padding: null,
    added_tokens: [special(257, '<|im_start|>'), special(258, '<|im_end|>')],
    normalizer: null,
    pre_tokenizer: { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true },
    post_processor: null,
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, vocab, merges: ['h e'],
    },
  });
}

// A SafeTensors file of f32 tensors [name, shape, values], header padded to 8 bytes.
function safetensors(tensors) {
  const header = {};
  let at = 0;
  for (const [name, shape, values] of tensors) {
    header[name] = { dtype: 'F32', shape, data_offsets: [at, at + 4 * values.length] };
    at += 4 * values.length;
  }
  let json = JSON.stringify(header);
  json += ' '.repeat((8 - (json.length % 8)) % 8);
  const out = Buffer.alloc(8 + json.length + at);
  out.writeBigUInt64LE(BigInt(json.length), 0);
  out.write(json, 8, 'latin1');
  let p = 8 + json.length;
  for (const [, , values] of tensors) {
    for (const v of values) { out.writeFloatLE(v, p); p += 4; }
  }
  return out;
}

// The tiny model's weights: uniform in (-0.6, 0.6) from a fixed seed (mulberry32), norms 1.
function weights() {
  let s = 4100;
  const rand = () => {
    s = (s + 0x6d2b79f5) | 0;
    let t = Math.imul(s ^ (s >>> 15), 1 | s);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const m = (rows, cols) => Array.from({ length: rows * cols }, () => (rand() - 0.5) * 1.2);
  const ones = (n) => new Array(n).fill(1);
  const { hidden_size: e, intermediate_size: f, vocab_size: v } = CFG;
  const d = e / CFG.num_attention_heads;
  const kv = CFG.num_key_value_heads * d;
  const t = [['model.embed_tokens.weight', [v, e], m(v, e)], ['model.norm.weight', [e], ones(e)]];
  for (let i = 0; i < CFG.num_hidden_layers; i++) {
    const l = `model.layers.${i}.`;
    t.push(
      [`${l}input_layernorm.weight`, [e], ones(e)],
      [`${l}self_attn.q_proj.weight`, [e, e], m(e, e)],
      [`${l}self_attn.k_proj.weight`, [kv, e], m(kv, e)],
      [`${l}self_attn.v_proj.weight`, [kv, e], m(kv, e)],
      [`${l}self_attn.o_proj.weight`, [e, e], m(e, e)],
      [`${l}post_attention_layernorm.weight`, [e], ones(e)],
      [`${l}mlp.gate_proj.weight`, [f, e], m(f, e)],
      [`${l}mlp.up_proj.weight`, [f, e], m(f, e)],
      [`${l}mlp.down_proj.weight`, [e, f], m(e, f)],
    );
  }
  return t;
}

function tinyDir() {
  const files = {
    'config.json': Buffer.from(JSON.stringify(CFG)),
    'tokenizer.json': Buffer.from(tokenizerJson()),
    'tokenizer_config.json': Buffer.from(JSON.stringify({ bos_token: null, eos_token: '<|im_end|>', add_bos_token: false })),
    'model.safetensors': safetensors(weights()),
  };
  const dir = mkdtempSync(join(tmpdir(), 'doppler-hf-'));
  for (const [name, bytes] of Object.entries(files)) writeFileSync(join(dir, name), bytes);
  return { dir, files };
}

test('a Hugging Face directory loads from Files and generates the native CLI\'s ids', async (t) => {
  const bin = dopplerBin();
  assert.ok(existsSync(bin), `${bin} is missing: cargo build -p doppler-cli, or set DOPPLER_BIN`);
  const { dir, files } = tinyDir();
  t.after(() => rmSync(dir, { recursive: true, force: true }));
  const { stdout } = await promisify(execFile)(
    bin, ['generate', '-m', dir, PROMPT, '-n', String(TOKENS), '--temperature', '0', '--json'],
    { cwd: REPO, maxBuffer: 1 << 24 },
  );
  const native = JSON.parse(stdout.trim().split('\n').filter((l) => l.startsWith('{')).pop());
  const b64 = Object.fromEntries(Object.entries(files).map(([n, b]) => [n, b.toString('base64')]));
  await withBrowser(t, async ({ page }) => {
    const got = await api(page, async (d, { b64, prompt, n }) => {
      const file = (name, bytes = Uint8Array.from(atob(b64[name]), (c) => c.charCodeAt(0))) =>
        new File([bytes], name);
      const all = () => Object.keys(b64).map((name) => file(name));
      await d.init();
      const phases = new Set();
      const m = await d.loadModel(all(), { maxContext: 64, onProgress: (p) => phases.add(p.phase) });
      const s = m.generate(prompt, { chat: false, maxTokens: n, temperature: 0 });
      let streamed = '';
      for await (const piece of s) streamed += piece;
      const r = await s.result;
      m.dispose();
      const live = d.poolStats().live_bytes;
      // Bad directories.
      const rejects = async (f) => {
        try { (await f()).dispose(); return { ok: true }; } catch (e) { return { ok: false, message: String(e.message ?? e) }; }
      };
      const st = Uint8Array.from(atob(b64['model.safetensors']), (c) => c.charCodeAt(0));
      const others = all().filter((f) => f.name !== 'model.safetensors');
      const badHeader = st.slice();
      badHeader[8] = 0x7b + 1; // the header's "{" made "|"
      const bad = {
        noTokenizer: await rejects(() => d.loadModel(all().filter((f) => f.name !== 'tokenizer.json'))),
        header: await rejects(() => d.loadModel([...others, file('model.safetensors', badHeader)])),
        cut: await rejects(() => d.loadModel([...others, file('model.safetensors', st.slice(0, st.length - 100))])),
        hugeHeader: await rejects(() => d.loadModel([...others, file('model.safetensors', new Uint8Array([255, 255, 255, 255, 0, 0, 0, 0, 1, 2]))])),
      };
      return { ...r, streamed, live, liveAfter: d.poolStats().live_bytes, phases: [...phases], bad };
    }, { b64, prompt: PROMPT, n: TOKENS });
    console.log(`browser: ${JSON.stringify(got.text)} ${JSON.stringify(got.tokens)}; native: ${JSON.stringify(native.text)} ${JSON.stringify(native.tokens)}`);
    console.log(`bad directories: ${JSON.stringify(got.bad)}`);
    assert.equal(got.promptTokens, native.prompt_tokens, 'prompt token count');
    assert.deepEqual(got.tokens, native.tokens, 'generated token ids');
    assert.equal(got.text, native.text);
    assert.equal(got.streamed, got.text);
    assert.deepEqual(got.phases, ['upload']);
    assert.equal(got.live, 0, 'GPU memory held after dispose');
    assert.equal(got.liveAfter, 0, 'GPU memory held after the failed loads');
    for (const [k, r] of Object.entries(got.bad)) assert.equal(r.ok, false, `${k}: loaded`);
    assert.match(got.bad.noTokenizer.message, /tokenizer\.json is missing/);
    assert.match(got.bad.header.message, /model\.safetensors.*SafeTensors header/);
    assert.match(got.bad.cut.message, /model\.safetensors.*data_offsets/);
    assert.match(got.bad.hugeHeader.message, /model\.safetensors.*not a SafeTensors file/);
  });
});
