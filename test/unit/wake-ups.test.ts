import { describe, expect, it } from 'vitest';
import { parseFreed, parseLeft } from '../../src/redis/wake-ups.js';
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

  it('reads a waiter leaving its line: the line and its count, and nothing else', () => {
    expect(parseLeft('left - 3')).toEqual({ line: '-', count: 3 });
    expect(parseLeft('left AbC_-9xyzAbC_-9x 12')).toEqual({ line: 'AbC_-9xyzAbC_-9x', count: 12 });
    for (const junk of ['left - 0', 'left -', 'left  3', 'left - 3 4', 'left - -3', '3', '[{"v":"1"}]']) expect(parseLeft(junk)).toBeNull();
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
