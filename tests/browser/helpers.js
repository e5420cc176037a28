// Shared by the browser tests: a static server for web/ (plus the model, configs/ and
// data/), headless Chromium through playwright-core (the system's /usr/bin/chromium, WebGPU
// on whatever Dawn finds: SwiftShader on a machine without a GPU), and the page's console,
// printed when a test fails.

import { createServer } from 'node:http';
import { createReadStream, existsSync, mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir, homedir } from 'node:os';
import { dirname, extname, join, normalize, resolve, sep } from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

export const REPO = resolve(dirname(fileURLToPath(import.meta.url)), '../..');
export const WEB = join(REPO, 'web');
export const OUT = join(REPO, 'tests/browser/out');
export const MODEL_NAME = 'SmolLM2-135M-Instruct.Q4_1.gguf';

/** The SmolLM2 GGUF: $DOPPLER_SMOLLM2, else scripts/fetch_model.sh's place in the cache. */
export function modelPath() {
  if (process.env.DOPPLER_SMOLLM2) return process.env.DOPPLER_SMOLLM2;
  const cache = process.env.DOPPLER_CACHE || join(homedir(), '.cache/doppler');
  return join(cache, 'models', MODEL_NAME);
}

/** The native CLI: $DOPPLER_BIN, else target/release/doppler (scripts/test.sh builds it). */
export function dopplerBin() {
  return process.env.DOPPLER_BIN || join(REPO, 'target/release/doppler');
}

const TYPES = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.mjs': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8',
  '.json': 'application/json',
  '.wasm': 'application/wasm',
  '.toml': 'text/plain; charset=utf-8',
  '.txt': 'text/plain; charset=utf-8',
  '.md': 'text/plain; charset=utf-8',
  '.png': 'image/png',
  '.svg': 'image/svg+xml',
  '.gguf': 'application/octet-stream',
};

/** An empty page of the server's origin, for tests of the JS API alone. */
export const BLANK = '/__blank.html';

/**
 * Serves web/ at /, and /models/, /configs/, /data/ (as scripts/web.sh lays them out with
 * symlinks) on 127.0.0.1 at a free port. Resolves to {url, close()}.
 */
export async function startServer() {
  const model = modelPath();
  const mounts = [
    ['/models/', dirname(model)],
    ['/configs/', join(REPO, 'configs')],
    ['/data/', join(REPO, 'data')],
    ['/', WEB],
  ];
  const server = createServer((req, res) => {
    const path = decodeURIComponent(new URL(req.url, 'http://x').pathname);
    if (path === BLANK) {
      res.writeHead(200, { 'content-type': TYPES['.html'] });
      res.end('<!doctype html><meta charset="utf-8"><link rel="icon" href="data:,"><title>blank</title>');
      return;
    }
    let file = null;
    for (const [prefix, dir] of mounts) {
      if (path.startsWith(prefix)) {
        const f = normalize(join(dir, path.slice(prefix.length)));
        if (f === dir || f.startsWith(dir + sep)) file = f;
        break;
      }
    }
    if (file && existsSync(file) && statSync(file).isDirectory()) file = join(file, 'index.html');
    if (!file || !existsSync(file)) {
      res.writeHead(404, { 'content-type': 'text/plain' });
      res.end(`not found: ${path}`);
      return;
    }
    res.writeHead(200, {
      'content-type': TYPES[extname(file)] ?? 'application/octet-stream',
      'content-length': statSync(file).size,
      'cache-control': 'no-store',
    });
    if (req.method === 'HEAD') return res.end();
    createReadStream(file).pipe(res);
  });
  await new Promise((ok) => server.listen(0, '127.0.0.1', ok));
  const url = `http://127.0.0.1:${server.address().port}`;
  return {
    url,
    close: () => new Promise((ok) => { server.closeAllConnections?.(); server.close(ok); }),
  };
}

export const CHROMIUM_ARGS = [
  '--headless=new', '--no-sandbox', '--enable-unsafe-webgpu', '--disable-background-networking',
  '--disable-component-update', '--disable-sync', '--no-first-run',
];

/**
 * Starts Chromium with a fresh profile and a server, opens `path` (default: the blank page)
 * and records the console. `webgpu: false` leaves out --enable-unsafe-webgpu; `initScript`
 * runs in the page before its own scripts. Returns {page, context, server, url, log, elapsed(), close()}.
 * `log` holds every console message and page error, with seconds since the start.
 */
export async function openBrowser({ path = BLANK, args = [], viewport, webgpu = true, initScript } = {}) {
  const t0 = Date.now();
  const server = await startServer();
  const profile = mkdtempSync(join(tmpdir(), 'doppler-chromium-'));
  let context;
  try {
    context = await chromium.launchPersistentContext(profile, {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
      headless: true,
      args: [...CHROMIUM_ARGS.filter((a) => webgpu || a !== '--enable-unsafe-webgpu'), ...args],
      viewport: viewport ?? { width: 1200, height: 900 },
    });
  } catch (e) {
    await server.close();
    rmSync(profile, { recursive: true, force: true });
    throw e;
  }
  const log = [];
  const stamp = () => ((Date.now() - t0) / 1000).toFixed(1).padStart(6);
  const page = context.pages()[0] ?? (await context.newPage());
  page.on('console', (m) => log.push(`${stamp()}s console.${m.type()}: ${m.text()}`));
  page.on('pageerror', (e) => log.push(`${stamp()}s pageerror: ${e.stack || e.message}`));
  page.on('crash', () => log.push(`${stamp()}s the page crashed`));
  page.on('requestfailed', (r) => log.push(`${stamp()}s request failed: ${r.url()} ${r.failure()?.errorText}`));
  page.on('response', (r) => { if (r.status() >= 400) log.push(`${stamp()}s HTTP ${r.status()}: ${r.url()}`); });
  if (initScript) await context.addInitScript(initScript);
  await page.goto(server.url + path);
  return {
    page,
    context,
    server,
    url: server.url,
    log,
    elapsed: () => (Date.now() - t0) / 1000,
    async close() {
      await context.close().catch(() => {});
      await server.close();
      rmSync(profile, { recursive: true, force: true });
    },
  };
}

/**
 * Runs `fn(browser)` in a fresh browser; on failure prints the page's console first.
 * Always prints how long it took.
 */
export async function withBrowser(t, opts, fn) {
  if (typeof opts === 'function') [opts, fn] = [{}, opts];
  const b = await openBrowser(opts);
  try {
    return await fn(b);
  } catch (e) {
    console.log(`--- console of the page (${t.name}) ---\n${b.log.join('\n') || '(empty)'}\n---`);
    throw e;
  } finally {
    console.log(`${t.name}: ${b.elapsed().toFixed(1)} s`);
    if (process.env.DOPPLER_BROWSER_LOG) console.log(b.log.join('\n'));
    await b.close();
  }
}

/** page.evaluate of an async function with the JS API imported as `d`. */
export function api(page, fn, arg) {
  return page.evaluate(
    async ([src, a]) => {
      const d = await import('/pkg/doppler.js');
      // eslint-disable-next-line no-new-func
      return await new Function('d', 'arg', `return (${src})(d, arg);`)(d, a);
    },
    [fn.toString(), arg],
  );
}
