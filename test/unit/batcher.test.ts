import { describe, expect, it } from 'vitest';
import { BatchWaitTimeout, Batcher } from '../../src/database/batcher.js';

/** Lets every pending promise callback run. */
const settled = () => new Promise((resolve) => setImmediate(resolve));

/** A batch runner whose calls the test completes by hand. */
function manualRunner() {
  const calls: { items: number[]; finish: (results: (string | Error)[]) => void; fail: (err: Error) => void }[] = [];
  const run = (items: number[]) =>
    new Promise<(string | Error)[]>((resolve, reject) => calls.push({ items, finish: resolve, fail: reject }));
  return { calls, run };
}

describe('Batcher (group commit)', () => {
  it('sends a lone item at once, and groups the items that arrive while the batches in flight are busy', async () => {
    const { calls, run } = manualRunner();
    const batcher = new Batcher<number, string>(run, 1, 3, 60_000);
    const first = batcher.submit(1);
    expect(calls.map((c) => c.items)).toEqual([[1]]);
    const waiting = [2, 3, 4, 5].map((n) => batcher.submit(n));
    expect(calls).toHaveLength(1); // the one batch allowed is in flight: the others wait
    calls[0].finish(['one']);
    expect(await first).toBe('one');
    await settled();
    expect(calls.map((c) => c.items)).toEqual([[1], [2, 3, 4]]); // at most 3 a batch
    calls[1].finish(['two', 'three', 'four']);
    await settled();
    expect(calls.map((c) => c.items)).toEqual([[1], [2, 3, 4], [5]]);
    calls[2].finish(['five']);
    expect(await Promise.all(waiting)).toEqual(['two', 'three', 'four', 'five']);
  });

  it('fails one item alone when its result is an error, and every item when the batch fails', async () => {
    const { calls, run } = manualRunner();
    const batcher = new Batcher<number, string>(run, 1, 10, 60_000);
    const lead = batcher.submit(0);
    const [a, b] = [batcher.submit(1), batcher.submit(2)];
    calls[0].finish(['ok']);
    expect(await lead).toBe('ok');
    await settled();
    calls[1].finish([new Error('conflict of 1'), 'two']);
    await expect(a).rejects.toThrow('conflict of 1');
    expect(await b).toBe('two');
    const busy = batcher.submit(9);
    const [c, d] = [batcher.submit(3), batcher.submit(4)];
    calls[2].finish(['nine']);
    expect(await busy).toBe('nine');
    await settled();
    expect(calls[3].items).toEqual([3, 4]);
    calls[3].fail(new Error('connection lost'));
    await expect(c).rejects.toThrow('connection lost');
    await expect(d).rejects.toThrow('connection lost');
  });

  it('runs up to maxInFlight batches at once', () => {
    const { calls, run } = manualRunner();
    const batcher = new Batcher<number, string>(run, 2, 10, 60_000);
    for (let n = 0; n < 5; n++) void batcher.submit(n).catch(() => undefined);
    expect(calls.map((c) => c.items)).toEqual([[0], [1]]);
  });

  it('refuses an item that no batch took within maxWaitMs, without ever sending it', async () => {
    const { calls, run } = manualRunner();
    const batcher = new Batcher<number, string>(run, 1, 10, 50);
    const busy = batcher.submit(1);
    const late = batcher.submit(2);
    await expect(late).rejects.toBeInstanceOf(BatchWaitTimeout);
    calls[0].finish(['one']);
    expect(await busy).toBe('one');
    await settled();
    expect(calls.map((c) => c.items)).toEqual([[1]]);
  });
});
