import { describe, expect, it } from 'vitest';
import { Later } from '../../src/common/later.js';

describe('Later: work kept until a dependency takes it', () => {
  it('keeps at most its maximum, one per key', () => {
    const later = new Later<number>(2);
    expect([later.add('a', 1), later.add('b', 2), later.add('c', 3), later.add('a', 4)]).toEqual([true, true, false, true]);
  });

  it('sends what it kept in order, and keeps what failed and what came after it for the next retry', async () => {
    const later = new Later<string>(10);
    for (const key of ['a', 'b', 'c']) later.add(key, key);
    const sent: string[] = [];
    const failing = async (work: string) => {
      if (work === 'b') throw new Error('Redis is down');
      sent.push(work);
    };
    await expect(later.retry(failing)).rejects.toThrow('Redis is down');
    expect(sent).toEqual(['a']);
    expect(await later.retry(async (work) => sent.push(work))).toBe(2);
    expect(sent).toEqual(['a', 'b', 'c']);
    expect(await later.retry(async (work) => sent.push(work))).toBe(0);
  });
});
