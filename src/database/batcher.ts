/** An item waited longer than `maxWaitMs` for a batch to take it. */
export class BatchWaitTimeout extends Error {}

interface Waiting<T, R> {
  item: T;
  resolve: (result: R) => void;
  reject: (err: unknown) => void;
  timer?: NodeJS.Timeout;
}

/**
 * Group commit: callers submit one item each; items that arrive while `maxInFlight` batches are already
 * running wait and go together in the next batch (up to `maxBatch`). A lone caller never waits: with
 * fewer batches in flight, its item is sent at once. An item not taken into a batch within `maxWaitMs`
 * is refused with BatchWaitTimeout (it was never sent). `run` answers each item of a batch with its
 * result, or with an Error for that item alone; if `run` throws, every item of the batch gets the error.
 */
export class Batcher<T, R> {
  private readonly queue: Waiting<T, R>[] = [];
  private inFlight = 0;

  constructor(
    private readonly run: (items: T[]) => Promise<(R | Error)[]>,
    private readonly maxInFlight: number,
    private readonly maxBatch: number,
    private readonly maxWaitMs: number,
  ) {}

  submit(item: T): Promise<R> {
    return new Promise<R>((resolve, reject) => {
      const waiting: Waiting<T, R> = { item, resolve, reject };
      this.queue.push(waiting);
      this.pump();
      // Still queued (pump takes from the front, this item is the last): every batch slot is busy. Only
      // then does it need a deadline.
      if (this.queue.length > 0) {
        waiting.timer = setTimeout(() => {
          const at = this.queue.indexOf(waiting);
          if (at < 0) return;
          this.queue.splice(at, 1);
          reject(new BatchWaitTimeout(`waited ${this.maxWaitMs} ms for a batch`));
        }, this.maxWaitMs);
        waiting.timer.unref();
      }
    });
  }

  private pump(): void {
    while (this.inFlight < this.maxInFlight && this.queue.length > 0) {
      const batch = this.queue.splice(0, this.maxBatch);
      for (const e of batch) clearTimeout(e.timer);
      this.inFlight++;
      void this.run(batch.map((e) => e.item))
        .then(
          (results) =>
            batch.forEach((e, i) => {
              const result = results[i];
              if (result instanceof Error) e.reject(result);
              else e.resolve(result);
            }),
          (err: unknown) => batch.forEach((e) => e.reject(err)),
        )
        .finally(() => {
          this.inFlight--;
          this.pump();
        });
    }
  }
}
