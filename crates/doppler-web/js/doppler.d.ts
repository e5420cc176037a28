// Types of Doppler's JS API (doppler.js).

export interface AdapterReport {
  name: string; backend: string; device_type: string; driver: string; driver_info: string;
  vendor: number; device: number; subgroup_min_size: number; subgroup_max_size: number;
  features: string[]; cooperative_matrix: string[];
  limits: Record<string, number>;
  matmul: 'f32' | 'f16x3' | 'f16';
  paths: {
    matmul: string; attention_d64: 'coop' | 'tiled' | 'rows';
    quantized_prompts: string; prompt_attention_d128: 'coop' | 'rows';
    shader_f16: boolean; subgroups: boolean; timestamps: boolean; per_kernel_times: boolean;
  };
}

export interface Progress { phase: 'download' | 'cache' | 'read' | 'upload'; file: string; loaded: number; total: number }

export interface LoadOptions { onProgress?: (p: Progress) => void; maxContext?: number; cache?: boolean }

export interface GenerateOptions {
  chat?: boolean; special?: boolean; maxTokens?: number; temperature?: number; topK?: number;
  topP?: number; minP?: number; repeatPenalty?: number; repeatLastN?: number; seed?: number;
  stop?: string[];
}

export interface Generation {
  text: string; tokens: number[]; promptTokens: number;
  stop: 'token' | 'string' | 'length' | 'context';
  prefillMs: number; prefillTokS: number; decodeTokS: number; tokenMs: number[];
  restarted?: boolean;
}

export class TextStream implements AsyncIterable<string> {
  readonly result: Promise<Generation>;
  abort(): void;
  text(): Promise<string>;
  [Symbol.asyncIterator](): AsyncIterator<string>;
}

export interface ModelInfo {
  name: string; arch: string; layers: number; embedding: number; heads: number; kvHeads: number;
  vocab: number; context: number; loadMs: number; chatTemplate: string | null;
}

export interface Chat {
  send(message: string, options?: GenerateOptions): TextStream;
  reset(): void;
  readonly length: number;
  dispose(): void;
}

export class Model {
  readonly info: ModelInfo;
  generate(prompt: string, options?: GenerateOptions): TextStream;
  chat(options?: { system?: string }): Chat;
  dispose(): void;
}

export interface CheckResult { op: string; shape: string; max_abs: number; max_rel: number; pass: boolean; error: string | null }

/** itemsPerS: tokens (text) or images (conv nets) a second. */
export interface TrainStep { type: 'step'; step: number; steps: number; loss: number; lr: number; itemsPerS: number; gradNorm: number | null; skipped: boolean }
/** valAccuracy: held-out accuracy of a classifier, else null. */
export interface TrainEval { type: 'eval'; step: number; valLoss: number; valAccuracy: number | null }
/** outputs: vocabulary size (text) or class count (images); items in `unit`. */
export interface TrainStart { type: 'started'; params: number; outputs: number; trainItems: number; valItems: number; unit: 'tokens' | 'images'; startStep: number; steps: number }

export interface TrainRun {
  summary: { steps: number; stopped: boolean; firstValLoss: number | null; finalValLoss: number; finalValAccuracy: number | null; finalTrainLoss: number; itemsPerS: number; seconds: number; params: number };
  safetensors(): Promise<Uint8Array>;
  tokenizerJson(): string;
  sample(prompt: string, options?: GenerateOptions): TextStream;
  dispose(): void;
}

export function init(): Promise<AdapterReport>;
export function poolStats(): { live_bytes: number; pooled_bytes: number; hits: number; misses: number; in_flight: number; wasm_bytes: number };
export function verify(options?: { filter?: string }): Promise<{ adapter: string; checks: CheckResult[]; failed: number }>;
export function loadModel(source: string | URL | Blob | ArrayBuffer | ArrayBufferView | FileList | File[], options?: LoadOptions): Promise<Model>;
export function cachedModel(url: string): Promise<{ sha256: string; size: number } | null>;
export function clearCache(): Promise<void>;
export function train(configToml: string, corpus: string, options?: {
  onStart?: (e: TrainStart) => void; onStep?: (e: TrainStep) => void; onEval?: (e: TrainEval) => void;
  maxSteps?: number;
  /** Ends the run after the current step and keeps it (summary.stopped). */
  stop?: AbortSignal;
  /** Abandons the run: the promise rejects with "train: aborted". */
  signal?: AbortSignal;
}): Promise<TrainRun>;
