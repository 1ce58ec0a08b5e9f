/**
 * Scaffolding of the model-based tests (model-lifecycle, tasks-model): seeded sequences of calls whose every
 * answer is judged against a reference model of API.md; a disagreement ends its sequence with the history
 * that replays it.
 */
import type { HttpAnswer, TestInstance } from './harness.js';
import type { Rng } from './random.js';

/** A disagreement with the model: the sequence ends, and the test reports it with the others. */
export class Mismatch extends Error {}

/** "1-10", "3,9" or "7": the seeds to run. */
export function parseSeeds(spec: string): number[] {
  const out: number[] = [];
  for (const part of spec.split(',')) {
    const [a, b] = part.split('-').map(Number);
    if (b === undefined) out.push(a);
    else for (let s = a; s <= b; s++) out.push(s);
  }
  return out;
}

/** Runs every seed's sequence; returns the Mismatch messages (any other error fails the test at once). */
export async function mismatches(seeds: number[], run: (seed: number) => Promise<void>): Promise<string[]> {
  const failures: string[] = [];
  for (const seed of seeds) {
    try {
      await run(seed);
    } catch (err) {
      if (!(err instanceof Mismatch)) throw err;
      failures.push(err.message);
    }
  }
  return failures;
}

/**
 * The judging helpers of one sequence. `replay` names the environment variables that run it again (as
 * `MODEL_SEEDS=3 MODEL_STEPS=40`); `history` is the sequence's log so far.
 */
export function judge(opts: { seed: number; steps: number; replay: [string, string]; history: string[]; rng: Rng; apis: TestInstance[] }) {
  const { seed, steps, replay, history, rng, apis } = opts;
  const fail = (step: number, what: string): never => {
    throw new Mismatch(
      `\n=== MISMATCH seed=${seed} step=${step}: ${what}\n--- history (replay with ${replay[0]}=${seed} ${replay[1]}=${steps}) ---\n` +
        history.map((h, i) => `${String(i).padStart(3)} ${h}`).join('\n'),
    );
  };
  /** One of the instances, at random. */
  const api = () => {
    const i = rng.int(0, apis.length - 1);
    return { i, a: apis[i] };
  };
  const short = (r: HttpAnswer) => `${r.status} ${JSON.stringify(r.body)?.slice(0, 400)}`;
  const errCode = (r: HttpAnswer): unknown => r.body?.error?.code;
  /** The status (and code) must be one of those allowed. */
  const expectStatus = (step: number, r: HttpAnswer, allowed: [number, string?][]) => {
    const ok = allowed.some(([s, c]) => r.status === s && (c === undefined || errCode(r) === c));
    if (!ok) fail(step, `expected ${allowed.map(([s, c]) => `${s}${c ? ' ' + c : ''}`).join(' or ')}, got ${short(r)}`);
  };
  return { fail, api, short, errCode, expectStatus };
}
