/**
 * Work a dependency refused now (Redis unreachable) that must still be done: kept by key, at most `max` of it,
 * and sent again by the sweeper's upkeep (`retry`) until it goes through. Past `max`, add() refuses and the
 * caller's fallback applies (the item expires, or the sweeper finds it by other means).
 */
export class Later<T> {
  private readonly pending = new Map<string, T>();

  constructor(private readonly max: number) {}

  /** False when `max` are waiting already: the work was not kept. */
  add(key: string, work: T): boolean {
    if (this.pending.size >= this.max && !this.pending.has(key)) return false;
    this.pending.set(key, work);
    return true;
  }

  /** Sends each kept piece of work in turn; stops at the first that fails (thrown). Returns how many went. */
  async retry(send: (work: T) => Promise<unknown>): Promise<number> {
    let done = 0;
    for (const [key, work] of [...this.pending]) {
      await send(work);
      this.pending.delete(key);
      done++;
    }
    return done;
  }
}
