/** Deterministic pseudo-random numbers for the randomized tests: a seed reproduces a failing sequence. */

/** mulberry32: a small, fast 32-bit generator; numbers in [0, 1). */
export function mulberry32(a: number): () => number {
  return () => {
    a |= 0;
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export class Rng {
  private next: () => number;
  constructor(seed: number) {
    this.next = mulberry32(seed);
  }
  int = (lo: number, hi: number) => lo + Math.floor(this.next() * (hi - lo + 1));
  pick = <T>(xs: readonly T[]): T => xs[Math.floor(this.next() * xs.length)];
  chance = (p: number) => this.next() < p;
  shuffle = <T>(xs: readonly T[]): T[] => {
    const a = [...xs];
    for (let i = a.length - 1; i > 0; i--) {
      const j = Math.floor(this.next() * (i + 1));
      [a[i], a[j]] = [a[j], a[i]];
    }
    return a;
  };
  weighted = <T>(choices: [number, T][]): T => {
    const total = choices.reduce((s, [w]) => s + w, 0);
    let x = this.next() * total;
    for (const [w, v] of choices) {
      if ((x -= w) < 0) return v;
    }
    return choices[choices.length - 1][1];
  };
}
