// Doppler's demo page: the adapter report, chat with a GGUF or Hugging Face model, training
// on Shakespeare with a live loss curve, and the kernel checks. Plain DOM code over the JS
// API in ./pkg/doppler.js (built by scripts/build_web.sh).

import * as doppler from './pkg/doppler.js';

const $ = (id) => document.getElementById(id);

// ---------------------------------------------------------------- status and errors

function setStatus(text) {
  $('status').textContent = text;
}

/** Shows a failed call's message in the page; the page stays usable. */
function showError(where, e) {
  const text = e instanceof Error ? e.message : String(e);
  console.error(`${where}: ${text}`);
  $('error-where').textContent = `${where}:`;
  $('error-text').textContent = text;
  $('error').hidden = false;
}

function clearError() {
  $('error').hidden = true;
}

$('error-close').addEventListener('click', clearError);
window.addEventListener('unhandledrejection', (ev) => showError('unexpected error', ev.reason));

/** Runs an async action with its buttons disabled; shows its error, if any. */
async function guarded(where, buttons, fn) {
  clearError();
  for (const b of buttons) b.disabled = true;
  try {
    return await fn();
  } catch (e) {
    showError(where, e);
    return undefined;
  } finally {
    for (const b of buttons) b.disabled = false;
  }
}

const fmtBytes = (n) =>
  n >= 1 << 30 ? `${(n / (1 << 30)).toFixed(2)} GiB`
    : n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB`
      : n >= 1 << 10 ? `${(n / (1 << 10)).toFixed(1)} KiB` : `${n} B`;
const fmtNum = (x, digits = 1) => (Number.isFinite(x) ? x.toFixed(digits) : '–');
/** A rate: one decimal, or two significant digits below 1 (a CPU adapter decodes slowly). */
const fmtRate = (x) => (!Number.isFinite(x) ? '–' : x >= 1 || x === 0 ? x.toFixed(1) : x.toPrecision(2));

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') e.className = v;
    else if (k === 'text') e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

// ---------------------------------------------------------------- tabs

const TABS = ['adapter', 'chat', 'train', 'verify'];

function showTab(name) {
  if (!TABS.includes(name)) name = 'adapter';
  for (const t of TABS) {
    $(`panel-${t}`).hidden = t !== name;
    $(`tab-${t}`).setAttribute('aria-selected', String(t === name));
  }
  if (name === 'train') loadConfig();
}

for (const t of TABS) {
  $(`tab-${t}`).addEventListener('click', () => {
    history.replaceState(null, '', `#${t}`);
    showTab(t);
  });
}
window.addEventListener('hashchange', () => showTab(location.hash.slice(1)));

// ---------------------------------------------------------------- adapter

let adapter = null;

function kvRows(table, rows) {
  table.replaceChildren(...rows.map(([k, v]) => el('tr', {}, el('th', { text: k }), el('td', { text: String(v) }))));
}

async function startGpu() {
  try {
    adapter = await doppler.init();
  } catch (e) {
    const msg = e instanceof Error ? e.message : String(e);
    $('no-webgpu-text').textContent = msg;
    $('no-webgpu').hidden = false;
    setStatus('No WebGPU adapter: the page cannot run models here.');
    kvRows($('adapter-summary'), [['error', msg]]);
    return;
  }
  const a = adapter;
  const p = a.paths ?? {};
  kvRows($('adapter-summary'), [
    ['name', a.name || '(not reported by the browser)'],
    ['backend', a.backend],
    ['device type', a.device_type],
    ['driver', [a.driver, a.driver_info].filter(Boolean).join(' ') || '(not reported)'],
    ['vendor / device', `0x${(a.vendor ?? 0).toString(16)} / 0x${(a.device ?? 0).toString(16)}`],
    ['subgroup size', a.subgroup_min_size === a.subgroup_max_size ? a.subgroup_min_size : `${a.subgroup_min_size}–${a.subgroup_max_size}`],
    ['matmul', `${a.matmul} (${p.matmul})`],
    ['attention (head dim 64)', p.attention_d64],
    ['shader-f16', p.shader_f16 ? 'yes' : 'no'],
    ['subgroups', p.subgroups ? 'yes' : 'no'],
    ['timestamps', p.timestamps ? 'yes' : 'no'],
    ['cooperative matrices', a.cooperative_matrix?.length ? a.cooperative_matrix.join(', ') : 'none'],
  ]);
  $('adapter-features').replaceChildren(
    ...(a.features.length ? a.features : ['(none)']).map((f) => el('li', { text: f })),
  );
  kvRows($('adapter-limits'), Object.entries(a.limits).map(([k, v]) => [k.replaceAll('_', ' '), v >= 1 << 20 ? `${v} (${fmtBytes(v)})` : v]));
  setStatus(`WebGPU ready: ${a.name || a.device_type} via ${a.backend}, ${p.matmul} matmul, ${p.attention_d64} attention.`);
}

// ---------------------------------------------------------------- chat: loading

let model = null;
let conversation = null;
let stream = null;

const loadButtons = () => [$('model-load-url'), $('model-unload')];

function onProgress({ phase, file, loaded, total }) {
  const bar = $('model-progress');
  const names = { download: 'downloading', cache: 'reading the cache', read: 'reading', upload: 'uploading to the GPU' };
  if (total > 0) {
    bar.max = total;
    bar.value = loaded;
    $('model-progress-text').textContent = `${names[phase] ?? phase} ${file}: ${fmtBytes(loaded)} of ${fmtBytes(total)} (${Math.floor((100 * loaded) / total)}%)`;
  } else {
    bar.removeAttribute('value'); // indeterminate
    $('model-progress-text').textContent = `${names[phase] ?? phase} ${file}${loaded ? `: ${fmtBytes(loaded)}` : ''}…`;
  }
}

function unloadModel() {
  if (stream) stream.abort();
  conversation?.dispose();
  conversation = null;
  model?.dispose();
  model = null;
  $('model-info').textContent = 'No model loaded.';
  $('model-unload').disabled = true;
  setChatEnabled(false);
}

async function load(source, label) {
  const inputs = [$('model-load-url'), $('model-file'), $('model-dir')];
  await guarded(`loading ${label}`, inputs, async () => {
    unloadModel();
    $('model-progress').value = 0;
    $('model-info').textContent = `Loading ${label}…`;
    setStatus(`Loading ${label}…`);
    const t0 = performance.now();
    try {
      model = await doppler.loadModel(source, { onProgress, cache: $('model-cache').checked });
    } catch (e) {
      $('model-info').textContent = 'No model loaded.';
      $('model-progress').value = 0;
      $('model-progress-text').textContent = '';
      setStatus('Loading failed.');
      throw e;
    }
    const i = model.info;
    $('model-progress').max = 1;
    $('model-progress').value = 1;
    $('model-progress-text').textContent =
      `loaded in ${((performance.now() - t0) / 1000).toFixed(1)} s (on the GPU in ${(i.loadMs / 1000).toFixed(1)} s)`;
    $('model-info').textContent =
      `${i.name}: ${i.arch}, ${i.layers} layers, width ${i.embedding}, ${i.heads} heads (${i.kvHeads} for keys and values), ` +
      `vocabulary ${i.vocab}, context ${i.context}; chat template ${i.chatTemplate ?? 'none'}`;
    $('chat-mode').value = i.chatTemplate ? 'chat' : 'complete';
    $('chat-mode').querySelector('option[value=chat]').disabled = !i.chatTemplate;
    $('chat-log').replaceChildren();
    $('chat-stats').textContent = '';
    setChatEnabled(true);
    $('model-unload').disabled = false;
    setStatus(`${i.name} is ready.`);
    $('chat-input').focus();
  });
}

$('model-load-url').addEventListener('click', () => {
  const url = $('model-url').value.trim();
  if (url) load(url, url.split('/').pop());
});
$('model-url').addEventListener('keydown', (ev) => {
  if (ev.key === 'Enter') $('model-load-url').click();
});
$('model-file').addEventListener('change', (ev) => {
  const f = ev.target.files[0];
  if (f) load(f, f.name);
  ev.target.value = '';
});
$('model-dir').addEventListener('change', (ev) => {
  const files = Array.from(ev.target.files);
  if (files.length) load(files, files[0].webkitRelativePath.split('/')[0] || 'directory');
  ev.target.value = '';
});
$('model-unload').addEventListener('click', () => {
  unloadModel();
  setStatus('Model unloaded.');
});

// Drag and drop: one .gguf file, or a directory (or its files) of a Hugging Face model.
async function entryFiles(entry, out) {
  if (entry.isFile) {
    out.push(await new Promise((ok, fail) => entry.file(ok, fail)));
  } else if (entry.isDirectory) {
    const reader = entry.createReader();
    for (;;) {
      const batch = await new Promise((ok, fail) => reader.readEntries(ok, fail));
      if (!batch.length) break;
      for (const e of batch) await entryFiles(e, out);
    }
  }
  return out;
}

const drop = $('model-drop');
for (const ev of ['dragenter', 'dragover']) {
  drop.addEventListener(ev, (e) => { e.preventDefault(); drop.classList.add('over'); });
}
drop.addEventListener('dragleave', () => drop.classList.remove('over'));
drop.addEventListener('drop', async (e) => {
  e.preventDefault();
  drop.classList.remove('over');
  const entries = Array.from(e.dataTransfer.items ?? [])
    .map((i) => i.webkitGetAsEntry?.())
    .filter(Boolean);
  let files;
  try {
    files = [];
    if (entries.length) for (const en of entries) await entryFiles(en, files);
    else files = Array.from(e.dataTransfer.files);
  } catch (err) {
    showError('reading the dropped files', err);
    return;
  }
  const gguf = files.find((f) => f.name.toLowerCase().endsWith('.gguf'));
  if (gguf) load(gguf, gguf.name);
  else if (files.length) load(files, entries[0]?.isDirectory ? entries[0].name : 'dropped files');
});
// A file dropped beside the zone must not navigate away from the page.
window.addEventListener('dragover', (e) => e.preventDefault());
window.addEventListener('drop', (e) => e.preventDefault());

// ---------------------------------------------------------------- chat: talking

function setChatEnabled(on) {
  for (const id of ['chat-input', 'chat-send', 'chat-reset']) $(id).disabled = !on;
  $('chat-stop').disabled = true;
}

function generateOptions() {
  return {
    maxTokens: Math.max(1, Math.floor(Number($('chat-max-tokens').value)) || 128),
    temperature: Math.max(0, Number($('chat-temperature').value) || 0),
    seed: Math.max(0, Math.floor(Number($('chat-seed').value) || 0)),
  };
}

function addMessage(role, text) {
  const m = el('div', { class: `msg ${role}` }, el('div', { class: 'who', text: role === 'user' ? 'You' : 'Model' }), el('div', { class: 'text', text }));
  $('chat-log').append(m);
  $('chat-log').scrollTop = $('chat-log').scrollHeight;
  return m;
}

function statsLine(r) {
  return `prompt ${r.promptTokens} tokens: prefill ${fmtRate(r.prefillTokS)} tok/s (${fmtNum(r.prefillMs, 0)} ms) · ` +
    `${r.tokens.length} tokens generated: decode ${fmtRate(r.decodeTokS)} tok/s · stop: ${r.stop}` +
    (r.restarted ? ' · the context was full: the conversation restarted' : '');
}

async function send() {
  const text = $('chat-input').value;
  if (!model || !text.trim() || stream) return;
  clearError();
  const mode = $('chat-mode').value;
  const opts = generateOptions();
  addMessage('user', text);
  $('chat-input').value = '';
  const reply = addMessage('assistant', '');
  reply.classList.add('streaming');
  const out = reply.querySelector('.text');
  $('chat-send').disabled = true;
  $('chat-reset').disabled = true;
  $('chat-stop').disabled = false;
  $('chat-stats').textContent = 'Thinking…';
  try {
    if (mode === 'chat') {
      conversation ??= model.chat({ system: $('chat-system').value.trim() || undefined });
      stream = conversation.send(text, opts);
    } else {
      stream = model.generate(text, { ...opts, chat: false });
      out.textContent = '';
    }
    let first = true;
    for await (const piece of stream) {
      if (first) { $('chat-stats').textContent = 'Generating…'; first = false; }
      out.textContent += piece;
      $('chat-log').scrollTop = $('chat-log').scrollHeight;
    }
    const r = await stream.result;
    $('chat-stats').textContent = statsLine(r);
    reply.dataset.done = 'true';
  } catch (e) {
    const msg = e instanceof Error ? e.message : String(e);
    if (/aborted/.test(msg)) {
      reply.append(el('div', { class: 'note', text: mode === 'chat' ? '(stopped; the conversation starts afresh)' : '(stopped)' }));
      $('chat-stats').textContent = 'Stopped.';
      reply.dataset.done = 'stopped';
    } else {
      reply.append(el('div', { class: 'note', text: `(failed: ${msg})` }));
      $('chat-stats').textContent = '';
      reply.dataset.done = 'error';
      showError('generate', e);
    }
  } finally {
    reply.classList.remove('streaming');
    stream = null;
    setChatEnabled(Boolean(model));
    $('chat-input').focus();
  }
}

$('chat-send').addEventListener('click', send);
$('chat-input').addEventListener('keydown', (ev) => {
  if (ev.key === 'Enter' && !ev.shiftKey) {
    ev.preventDefault();
    send();
  }
});
$('chat-stop').addEventListener('click', () => stream?.abort());
$('chat-reset').addEventListener('click', () => {
  try {
    conversation?.reset();
  } catch (e) {
    showError('reset', e);
  }
  $('chat-log').replaceChildren();
  $('chat-stats').textContent = '';
});
$('chat-system').addEventListener('change', () => {
  // A new system message starts a new conversation.
  conversation?.dispose();
  conversation = null;
  $('chat-log').replaceChildren();
});

// ---------------------------------------------------------------- train

let configLoaded = false;
let corpus = null; // {name, text}: the shipped corpus or digits once fetched, or the user's file
// What each task trains: its config and its shipped data.
const TASKS = {
  text: { config: 'configs/default.toml', data: 'data/corpus/shakespeare.txt', name: 'shakespeare.txt (shipped)', hint: '' },
  digits: { config: 'configs/digits_cnn.toml', data: 'data/digits/digits.csv', name: 'digits.csv (fetched)', hint: ' (run bash scripts/fetch_digits.sh)' },
};
const task = () => TASKS[$('train-task').value] ?? TASKS.text;
let trainRun = null;
let trainAbort = null;
let weightsUrl = null;
let tokenizerUrl = null;

async function loadConfig(replace = false) {
  if (configLoaded && !replace) return;
  configLoaded = true;
  const path = task().config;
  try {
    const r = await fetch(path);
    if (!r.ok) throw new Error(`${path}: HTTP ${r.status} (serve the page with scripts/web.sh)`);
    if (replace || !$('train-config').value) $('train-config').value = await r.text();
  } catch (e) {
    configLoaded = false;
    showError('loading the default config', e);
  }
}

async function corpusText() {
  if (corpus) return corpus.text;
  const { data, name, hint } = task();
  setStatus(`Fetching ${data}…`);
  const r = await fetch(data);
  if (!r.ok) throw new Error(`${data}: HTTP ${r.status}${hint} (serve the page with scripts/web.sh)`);
  corpus = { name, text: await r.text() };
  return corpus.text;
}

$('train-task').addEventListener('change', () => {
  corpus = null;
  $('train-corpus-name').textContent = task().name;
  loadConfig(true);
});

$('train-corpus-file').addEventListener('change', async (ev) => {
  const f = ev.target.files[0];
  if (!f) return;
  corpus = { name: f.name, text: await f.text() };
  $('train-corpus-name').textContent = `${f.name} (${fmtBytes(f.size)})`;
});

// The loss chart: train loss per step, validation loss at each evaluation, and for
// classifiers the validation accuracy (right axis, 0-100%).
const chart = { steps: 0, train: [], val: [], acc: [], pending: false };
const SVG = 'http://www.w3.org/2000/svg';

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function drawChart() {
  chart.pending = false;
  const box = $('train-chart');
  const W = 640, H = 320, L = 52, R = 12, T = 12, B = 34;
  const pts = [...chart.train, ...chart.val];
  const nodes = [];
  const maxStep = Math.max(chart.steps, ...pts.map((p) => p[0]), 1);
  let lo = Math.min(...pts.map((p) => p[1]));
  let hi = Math.max(...pts.map((p) => p[1]));
  if (!pts.length) { lo = 0; hi = 1; }
  if (hi - lo < 1e-6) { hi += 0.5; lo -= 0.5; }
  const pad = (hi - lo) * 0.05;
  lo -= pad; hi += pad;
  const x = (s) => L + ((W - L - R) * s) / maxStep;
  const y = (v) => T + ((H - T - B) * (hi - v)) / (hi - lo);
  nodes.push(svg('rect', { x: L, y: T, width: W - L - R, height: H - T - B, class: 'plot' }));
  for (let i = 0; i <= 4; i++) {
    const v = lo + ((hi - lo) * i) / 4;
    nodes.push(svg('line', { x1: L, x2: W - R, y1: y(v), y2: y(v), class: 'grid' }));
    const t = svg('text', { x: L - 6, y: y(v) + 4, class: 'tick', 'text-anchor': 'end' });
    t.textContent = v.toFixed(2);
    nodes.push(t);
  }
  // Step ticks at a round interval (1, 2 or 5 times a power of ten), about five of them.
  const p10 = 10 ** Math.floor(Math.log10(Math.max(maxStep / 5, 1)));
  const dx = [1, 2, 5, 10].map((m) => m * p10).find((d) => d >= maxStep / 5) ?? 10 * p10;
  for (let s = 0; s <= maxStep; s += Math.max(1, dx)) {
    const t = svg('text', { x: x(s), y: H - B + 16, class: 'tick', 'text-anchor': 'middle' });
    t.textContent = String(s);
    nodes.push(t);
  }
  const xl = svg('text', { x: (L + W - R) / 2, y: H - 4, class: 'axis', 'text-anchor': 'middle' });
  xl.textContent = 'step';
  nodes.push(xl);
  const line = (data, id) => svg('polyline', { id, class: id, points: data.map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`).join(' ') });
  nodes.push(line(chart.train, 'train-line'), line(chart.val, 'val-line'));
  for (const [s, v] of chart.val) nodes.push(svg('circle', { cx: x(s), cy: y(v), r: 3, class: 'val-dot' }));
  const legend = [['train loss', 'train-line'], ['validation loss', 'val-line']];
  if (chart.acc.length) {
    const ya = (a) => T + (H - T - B) * (1 - a);
    for (const a of [0, 0.5, 1]) {
      const t = svg('text', { x: W - R - 4, y: ya(a) + (a === 1 ? 12 : -4), class: 'tick acc-tick', 'text-anchor': 'end' });
      t.textContent = `${a * 100}%`;
      nodes.push(t);
    }
    nodes.push(svg('polyline', { id: 'acc-line', class: 'acc-line', points: chart.acc.map(([s, a]) => `${x(s).toFixed(1)},${ya(a).toFixed(1)}`).join(' ') }));
    for (const [s, a] of chart.acc) nodes.push(svg('circle', { cx: x(s), cy: ya(a), r: 3, class: 'acc-dot' }));
    legend.push(['validation accuracy', 'acc-line']);
  }
  legend.forEach(([name, cls], i) => {
    const lx = W - R - 150, ly = T + 16 + i * 18;
    nodes.push(svg('line', { x1: lx, x2: lx + 20, y1: ly - 4, y2: ly - 4, class: cls }));
    const t = svg('text', { x: lx + 26, y: ly, class: 'legend' });
    t.textContent = name;
    nodes.push(t);
  });
  box.replaceChildren(...nodes);
}

function redraw() {
  if (!chart.pending) {
    chart.pending = true;
    requestAnimationFrame(drawChart);
  }
}

function setDownload(a, url, name) {
  if (url) {
    a.href = url;
    a.download = name;
    a.classList.remove('disabled');
    a.removeAttribute('aria-disabled');
  } else {
    a.removeAttribute('href');
    a.classList.add('disabled');
    a.setAttribute('aria-disabled', 'true');
  }
}

function dropRun() {
  trainRun?.dispose();
  trainRun = null;
  for (const u of [weightsUrl, tokenizerUrl]) if (u) URL.revokeObjectURL(u);
  weightsUrl = tokenizerUrl = null;
  setDownload($('train-download'), null);
  setDownload($('train-download-tokenizer'), null);
  $('train-sample').disabled = true;
}

async function startTraining() {
  clearError();
  dropRun();
  $('train-start').disabled = true;
  $('train-stop').disabled = false;
  $('train-summary').textContent = '';
  $('train-sample-out').textContent = '';
  Object.assign(chart, { steps: 0, train: [], val: [], acc: [] });
  redraw();
  trainAbort = new AbortController();
  let lastStep = 0;
  let unit = 'tokens';
  let accuracy = null;
  try {
    const text = await corpusText();
    const maxSteps = Number($('train-max-steps').value) || undefined;
    $('train-status').textContent = 'Preparing the data (the tokenizer is trained first)…';
    setStatus('Training…');
    const t0 = performance.now();
    const run = await doppler.train($('train-config').value, text, {
      maxSteps,
      stop: trainAbort.signal, // Stop ends the run after its step and keeps it
      onStart: (e) => {
        chart.steps = maxSteps ? Math.min(e.steps, e.startStep + maxSteps) : e.steps;
        $('train-status').textContent =
          `${e.params.toLocaleString()} parameters, ${e.unit === 'tokens' ? 'vocabulary ' + e.outputs : e.outputs + ' classes'}; ` +
          `${e.trainItems.toLocaleString()} training and ${e.valItems.toLocaleString()} validation ${e.unit}`;
        unit = e.unit;
        $('train-chart').dataset.params = e.params;
        redraw();
      },
      onStep: (e) => {
        lastStep = e.step;
        chart.train.push([e.step, e.loss]);
        $('train-status').textContent =
          `step ${e.step}/${chart.steps || e.steps}: loss ${e.loss.toFixed(4)}, lr ${e.lr.toExponential(2)}, ` +
          `${Math.round(e.itemsPerS).toLocaleString()} ${unit}/s${e.skipped ? ' (overflow: step skipped)' : ''}` +
          (accuracy == null ? '' : `, validation accuracy ${(accuracy * 100).toFixed(1)}%`);
        redraw();
      },
      onEval: (e) => {
        chart.val.push([e.step, e.valLoss]);
        accuracy = e.valAccuracy;
        if (accuracy != null) chart.acc.push([e.step, accuracy]);
        redraw();
      },
    });
    trainRun = run;
    const s = run.summary;
    $('train-summary').textContent =
      `${s.stopped ? 'Stopped' : 'Done'}: ${s.steps} steps in ${s.seconds.toFixed(1)} s (${Math.round(s.itemsPerS).toLocaleString()} ${unit}/s); ` +
      `validation loss ${s.firstValLoss == null ? '–' : s.firstValLoss.toFixed(4)} → ${s.finalValLoss.toFixed(4)}` +
      (s.finalValAccuracy == null ? ', ' : ` (accuracy ${(s.finalValAccuracy * 100).toFixed(2)}%), `) +
      `final train loss ${s.finalTrainLoss.toFixed(4)}.`;
    $('train-summary').dataset.done = s.stopped ? 'stopped' : 'true';
    setStatus(`Training ${s.stopped ? 'stopped' : 'done'} in ${((performance.now() - t0) / 1000).toFixed(1)} s.`);
    const weights = await run.safetensors();
    weightsUrl = URL.createObjectURL(new Blob([weights], { type: 'application/octet-stream' }));
    setDownload($('train-download'), weightsUrl, 'model.safetensors');
    $('train-download').title = fmtBytes(weights.length);
    if (unit === 'tokens') {
      // A text model: its tokenizer, and samples of its text.
      tokenizerUrl = URL.createObjectURL(new Blob([run.tokenizerJson()], { type: 'application/json' }));
      setDownload($('train-download-tokenizer'), tokenizerUrl, 'tokenizer.json');
      $('train-sample').disabled = false;
    }
  } catch (e) {
    $('train-summary').dataset.done = 'error';
    setStatus(`Training failed${lastStep ? ` at step ${lastStep}` : ''}.`);
    showError('train', e);
  } finally {
    trainAbort = null;
    $('train-start').disabled = false;
    $('train-stop').disabled = true;
  }
}

$('train-start').addEventListener('click', startTraining);
$('train-stop').addEventListener('click', () => trainAbort?.abort());
$('train-sample').addEventListener('click', async () => {
  if (!trainRun) return;
  await guarded('sample', [$('train-sample'), $('train-start')], async () => {
    const prompt = $('train-sample-prompt').value;
    const out = $('train-sample-out');
    out.textContent = prompt;
    delete out.dataset.done;
    const maxTokens = Math.max(1, Math.floor(Number($('train-sample-tokens').value)) || 200);
    const s = trainRun.sample(prompt, { maxTokens, temperature: 0.8 });
    for await (const piece of s) out.textContent += piece;
    await s.result;
    out.dataset.done = 'true';
  });
});

// ---------------------------------------------------------------- verify

let lastChecks = [];

function renderChecks() {
  const only = $('verify-failures').checked;
  const fmt = (v) => (v === 0 ? '0' : v.toExponential(2));
  $('verify-table').tBodies[0].replaceChildren(
    ...lastChecks.filter((c) => !only || !c.pass).map((c) =>
      el('tr', { class: c.pass ? 'pass' : 'fail' },
        el('td', { text: c.op }), el('td', { text: c.shape }),
        el('td', { class: 'num', text: fmt(c.max_abs) }), el('td', { class: 'num', text: fmt(c.max_rel) }),
        el('td', { class: 'result', text: c.pass ? 'pass' : 'FAIL' }), el('td', { text: c.error ?? '' }))),
  );
}

$('verify-failures').addEventListener('change', renderChecks);
$('verify-filter').addEventListener('keydown', (ev) => {
  if (ev.key === 'Enter') $('verify-run').click();
});
$('verify-run').addEventListener('click', () =>
  guarded('verify', [$('verify-run')], async () => {
    const filter = $('verify-filter').value.trim() || undefined;
    lastChecks = [];
    renderChecks();
    delete $('verify-summary').dataset.done;
    $('verify-summary').textContent = `Running ${filter ? `the checks matching “${filter}”` : 'every check'}… (each new kernel compiles first)`;
    const t0 = performance.now();
    try {
      const r = await doppler.verify({ filter });
      lastChecks = r.checks;
      renderChecks();
      const secs = ((performance.now() - t0) / 1000).toFixed(1);
      $('verify-summary').textContent = r.checks.length
        ? `${r.checks.length - r.failed} of ${r.checks.length} checks pass, ${r.failed} fail (${secs} s).`
        : `No check matches “${filter}”.`;
      $('verify-summary').dataset.done = r.failed ? 'fail' : 'pass';
    } catch (e) {
      $('verify-summary').textContent = '';
      throw e;
    }
  }));

// ---------------------------------------------------------------- start

showTab(location.hash.slice(1));
drawChart();
startGpu();
