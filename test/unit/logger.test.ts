import { describe, expect, it } from 'vitest';
import { createPino, PinoLoggerService } from '../../src/common/logger.js';

/** The JSON lines a logger at `level` writes while `write` runs. */
function linesOf(level: string, write: (logger: PinoLoggerService) => void): Record<string, unknown>[] {
  const out: string[] = [];
  const logger = new PinoLoggerService(createPino(level, { write: (line: string) => out.push(line) }));
  write(logger);
  return out.map((line) => JSON.parse(line) as Record<string, unknown>);
}

describe('logger', () => {
  it('writes JSON lines with the level by name and the context Nest passes', () => {
    const lines = linesOf('info', (logger) => {
      logger.log('started', 'Bootstrap');
      logger.warn({ reqId: 'r-1', msg: 'slow' }, 'Http');
      logger.error(new Error('boom'), 'Sweeper');
    });
    expect(lines.map((l) => [l.level, l.context, l.msg])).toEqual([
      ['info', 'Bootstrap', 'started'],
      ['warn', 'Http', 'slow'],
      ['error', 'Sweeper', 'boom'],
    ]);
    expect(lines[1].reqId).toBe('r-1');
    expect((lines[2].err as { stack: string }).stack).toContain('boom');
  });

  it('drops what is below its level', () => {
    const lines = linesOf('warn', (logger) => {
      logger.log('not shown');
      logger.debug('not shown');
      logger.warn('shown');
    });
    expect(lines.map((l) => [l.level, l.msg])).toEqual([['warn', 'shown']]);
  });
});
