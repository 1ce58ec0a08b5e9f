import { Exclude, plainToInstance, Type } from 'class-transformer';
import { getMetadataStorage, IsOptional, IsString, ValidateNested, validateSync } from 'class-validator';
import { describe, expect, it } from 'vitest';
import { AppConfig } from '../../src/config/app-config.js';
import { compileDto, DtoClass } from '../../src/common/compiled-dto.js';
import { DtoValidationPipe, VALIDATOR_OPTIONS } from '../../src/common/validation.js';
import * as poolDtos from '../../src/pools/pool.dto.js';
import * as reservationDtos from '../../src/reservations/reservation.dto.js';
import * as taskDtos from '../../src/tasks/task.dto.js';

/** Every exported class with validation decorators: the DTOs requests are validated against. */
const DTOS: DtoClass[] = [poolDtos, reservationDtos, taskDtos]
  .flatMap((module) => Object.values(module))
  .filter((value): value is DtoClass => typeof value === 'function' && validated(value));

function validated(cls: DtoClass): boolean {
  return getMetadataStorage().getTargetValidationMetadatas(cls, undefined as unknown as string, false, false).length > 0;
}

const range = (n: number, from = 1) => Array.from({ length: n }, (_, i) => String(i + from));
const long = (n: number) => 'x'.repeat(n);
const SCALARS: unknown[] = [
  undefined,
  null,
  '',
  'a',
  'bj',
  long(64),
  long(65),
  long(128),
  long(129),
  long(256),
  long(257),
  'a\u0000b',
  '138',
  '5780',
  '0',
  '1',
  '9223372036854775807',
  '9223372036854775808',
  '-1',
  'phone-bj',
  'Phone',
  '_x',
  'number',
  'task',
  'numbers',
  'phone-bj.9b2d7c1e-1f7a-4c55-9a43-2b0f6f1d2e11',
  'phone-bj.9b2d7c1e-1f7a-1c55-9a43-2b0f6f1d2e11',
  0,
  1,
  2,
  3,
  -1,
  1.5,
  63,
  99,
  100,
  101,
  999,
  1000,
  30_000,
  30_001,
  600_000,
  86_400_000,
  86_400_001,
  1e12,
  true,
  false,
];
const ARRAYS: unknown[] = [[], ['1'], ['1', '2'], ['1', '1'], ['0'], [1], ['5780', 'abc'], range(100), range(101), [null], [{}], [[]]];
const OBJECTS: unknown[] = [
  {},
  { city: 'bj' },
  { city: 'bj', size: 'l' },
  { city: 1 },
  { '': 'x' },
  { city: { a: 'b' } },
  { city: 'b\u0000j' },
  { constructor: 'x' },
  { city: long(257) },
  Object.fromEntries(range(33).map((k) => [`k${k}`, 'v'])),
];

const RESERVATION_ID = 'phone-bj.9b2d7c1e-1f7a-4c55-9a43-2b0f6f1d2e11';
/** Values that pass, by property name, so that about half of the samples are valid. */
const GOOD: Record<string, (next: () => number) => unknown[]> = {
  owner: () => ['u', 'user-123'],
  reviewer: () => ['r1'],
  count: () => [1, 3, 100],
  ttlMs: () => [1000, 60_000],
  leaseMs: () => [1000, 60_000],
  holdTtlMs: () => [1000, 60_000],
  maxHoldTtlMs: () => [600_000],
  maxHoldsPerOwner: () => [null, 5],
  waitMs: () => [0],
  valuePrefix: () => ['138'],
  attributes: () => [{ city: 'bj' }, {}],
  resourceIds: () => [['5780'], ['1', '2']],
  id: () => [RESERVATION_ID, '5780'],
  leaseId: () => [RESERVATION_ID],
  pool: () => ['phone-bj'],
  name: () => ['phone-bj'],
  kind: () => ['number', 'task'],
  value: () => ['13800138000'],
  groupKey: () => ['g1'],
  filter: (next) => [sample(reservationDtos.ReservationFilterDto, next, 1)],
  items: (next) => [Array.from({ length: 1 + Math.floor(next() * 3) }, () => sample(poolDtos.ImportItemDto, next, 1))],
};

/** A small deterministic generator (mulberry32), so a failure can be replayed. */
function random(seed: number): () => number {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 2 ** 32;
  };
}

/** Keys class-transformer treats apart: it skips them on a DTO, and in a plain record throws or drops them. */
const SPECIAL_KEYS = ['constructor', 'toString', 'valueOf', 'hasOwnProperty'];

/** Whether a plain record (an object below the top level) has one of SPECIAL_KEYS: there build and class-transformer differ. */
function specialBelowTop(value: unknown, depth = 0): boolean {
  if (Array.isArray(value)) return value.some((v) => specialBelowTop(v, depth + 1));
  if (value === null || typeof value !== 'object') return false;
  if (depth > 0 && Object.keys(value).some((k) => SPECIAL_KEYS.includes(k))) return true;
  return Object.values(value).some((v) => specialBelowTop(v, depth + 1));
}

function properties(cls: DtoClass): string[] {
  return Object.keys(
    getMetadataStorage().groupByPropertyName(
      getMetadataStorage().getTargetValidationMetadatas(cls, undefined as unknown as string, false, false),
    ),
  );
}

/** A JSON-like value for a DTO: each property absent or drawn from values that pass and fail its rules. */
function sample(cls: DtoClass, next: () => number, depth = 0): Record<string, unknown> {
  const pick = <T>(list: T[]) => list[Math.floor(next() * list.length)];
  const nested = DTOS.filter((other) => other !== cls && depth < 2);
  const value: Record<string, unknown> = {};
  for (const name of properties(cls)) {
    if (next() < 0.4) continue;
    const kind = next();
    if (GOOD[name] && kind < 0.6) value[name] = pick(GOOD[name](next));
    else if (kind < 0.75) value[name] = pick(SCALARS);
    else if (kind < 0.82) value[name] = pick(ARRAYS);
    else if (kind < 0.88) value[name] = pick(OBJECTS);
    else if (kind < 0.94 && nested.length > 0) value[name] = sample(pick(nested), next, depth + 1);
    else value[name] = Array.from({ length: 1 + Math.floor(next() * 3) }, () => sample(pick(DTOS), next, depth + 1));
  }
  if (next() < 0.08) value[pick(['extra', 'Owner', ...SPECIAL_KEYS])] = 'x';
  return value;
}

describe('compiled DTOs', () => {
  it('covers the DTOs requests are validated against', () => {
    const names = DTOS.map((cls) => cls.name);
    for (const hot of [
      'CreateReservationDto',
      'ConfirmDto',
      'ReservationParams',
      'PoolParams',
      'NextTaskDto',
      'LeaseParams',
      'ImportResourcesDto',
    ]) {
      expect(names).toContain(hot);
    }
    for (const cls of DTOS) expect(compileDto(cls), cls.name).toBeDefined();
  });

  it.each(DTOS.map((cls) => [cls.name, cls] as const))(
    '%s: builds what plainToInstance builds and passes exactly what validateSync passes',
    (_name, cls) => {
      const dto = compileDto(cls)!;
      const next = random(cls.name.length * 7919);
      let valid = 0;
      let invalid = 0;
      let compared = 0;
      const distinct = new Set<string>();
      for (let i = 0; i < 3000; i++) {
        const plain = sample(cls, next);
        distinct.add(JSON.stringify(plain));
        const built = dto.build(plain);
        if (!specialBelowTop(plain)) {
          expect(built).toStrictEqual(plainToInstance(cls, plain));
          compared++;
        }
        const passes = validateSync(built, VALIDATOR_OPTIONS).length === 0;
        expect(dto.passes(built), JSON.stringify(plain)).toBe(passes);
        if (passes) valid++;
        else invalid++;
      }
      // Samples that differ (a generator that repeats itself would prove little), as many as a class's properties allow.
      expect(distinct.size).toBeGreaterThan(Math.min(1000, 250 * properties(cls).length));
      expect(compared).toBeGreaterThan(2000);
      // Both sides were exercised: a generator that only made invalid values would prove nothing.
      expect(valid).toBeGreaterThan(30);
      expect(invalid).toBeGreaterThan(300);
    },
  );

  it('leaves classes it does not mirror to class-transformer and class-validator', () => {
    expect(compileDto(AppConfig)).toBeUndefined(); // @Transform
    class NoRules {
      name?: string;
    }
    expect(compileDto(NoRules)).toBeUndefined();
    class Meta {
      @IsString()
      tag!: string;
    }
    class TypeByValue {
      @ValidateNested()
      @Type((options) => (options?.object ? Meta : Meta))
      meta!: Meta;
    }
    expect(compileDto(TypeByValue)).toBeUndefined(); // its class may depend on the value
    @Exclude()
    class ExcludeAll {
      @IsOptional()
      @IsString()
      name?: string;
    }
    expect(compileDto(ExcludeAll)).toBeUndefined();
    class Base {
      describe(): string {
        return 'base';
      }
    }
    class WithMethod extends Base {
      @IsString()
      name!: string;
    }
    expect(compileDto(WithMethod)).toBeUndefined(); // class-transformer skips keys named like methods
  });

  it('skips the keys class-transformer skips on a DTO, and keeps every key of a plain record', () => {
    const dto = compileDto(reservationDtos.CreateReservationDto)!;
    const plain = { owner: 'u', toString: 'x', filter: { valueOf: 'v', attributes: { toString: 't', city: 'bj' } } };
    const built = dto.build(plain) as reservationDtos.CreateReservationDto;
    expect(Object.keys(built)).not.toContain('toString');
    expect(Object.keys(built.filter!)).not.toContain('valueOf');
    expect(built.filter!.attributes).toEqual({ toString: 't', city: 'bj' }); // class-transformer dropped "toString"
    expect(dto.passes(built)).toBe(true);
    // The fields of the skipped keys, for the pipe to refuse, nested in arrays too.
    const skipped: string[] = [];
    dto.build(plain, skipped);
    expect(skipped).toEqual(['toString', 'filter.valueOf']);
    const items: object[] = [{ value: '1' }, { value: '2', hasOwnProperty: 'h' }];
    const imported: string[] = [];
    expect(compileDto(poolDtos.ImportResourcesDto)!.build({ items }, imported)).toEqual({ items: [{ value: '1' }, { value: '2' }] });
    expect(imported).toEqual(['items.1.hasOwnProperty']);
  });

  it('answers a refused value with the messages class-validator writes', () => {
    const pipe = new DtoValidationPipe();
    const run = (body: unknown) => {
      try {
        pipe.transform(body, { type: 'body', metatype: reservationDtos.CreateReservationDto });
        return undefined;
      } catch (err) {
        return (err as { details: unknown }).details;
      }
    };
    expect(run({ owner: 'u', count: 3 })).toBeUndefined();
    expect(run({ owner: '', count: 101, extra: 1 })).toEqual({
      fields: [
        { field: 'extra', reason: 'property extra should not exist' },
        { field: 'owner', reason: 'owner must be a string of 1 to 128 characters' },
        { field: 'count', reason: 'count must not be greater than 100' },
      ],
    });
    // class-transformer throws on a record with a "constructor" key (a 500 before); it is data here.
    const dto = pipe.transform(
      { owner: 'u', filter: { attributes: { constructor: 'x', city: 'bj' } } },
      { type: 'body', metatype: reservationDtos.CreateReservationDto },
    ) as reservationDtos.CreateReservationDto;
    expect(dto.filter).toBeInstanceOf(reservationDtos.ReservationFilterDto);
    expect(dto.filter!.attributes).toEqual({ constructor: 'x', city: 'bj' });
  });
});
