import { describe, expect, it } from 'vitest';
import { parseFreed } from '../../src/redis/wake-ups.js';
import { matchesFilter } from '../../src/reservations/reservations.service.js';

describe('wake-up messages', () => {
  it('reads the items a script listed, or the count it gave, and nothing else', () => {
    expect(parseFreed('[{"v":"138","a":{"color":"red"}},{"v":"139"},{"v":"140","a":{}}]')).toEqual({
      count: 3,
      items: [{ v: '138', a: { color: 'red' } }, { v: '139' }, { v: '140', a: {} }],
    });
    expect(parseFreed('40')).toEqual({ count: 40 });
    for (const junk of ['0', '', '[]', '{}', '[{"a":{}}]', '[1]', 'not json', '-3', '[{"v":1}]']) expect(parseFreed(junk)).toBeNull();
  });

  it('matches a filter as the reserve script does: a value prefix and every attribute pair', () => {
    const item = { v: '13800000000', a: { color: 'red', size: 'l' } };
    expect(matchesFilter(item, {})).toBe(true);
    expect(matchesFilter(item, { valuePrefix: '138' })).toBe(true);
    expect(matchesFilter(item, { valuePrefix: '139' })).toBe(false);
    expect(matchesFilter(item, { attributes: { color: 'red' } })).toBe(true);
    expect(matchesFilter(item, { attributes: { color: 'red', size: 's' } })).toBe(false);
    expect(matchesFilter(item, { valuePrefix: '138', attributes: { color: 'blue' } })).toBe(false);
    expect(matchesFilter({ v: '13800000000' }, { attributes: { color: 'red' } })).toBe(false);
  });
});
