import { applyDecorators } from '@nestjs/common';
import { ApiExtraModels, ApiProperty, ApiResponse, getSchemaPath } from '@nestjs/swagger';
import { ErrorCode, HTTP_STATUS } from './errors.js';

export class ErrorDetailDto {
  @ApiProperty({ description: 'Machine-readable error code', enum: ErrorCode })
  code: ErrorCode;

  @ApiProperty({ description: 'Human-readable explanation' })
  message: string;

  @ApiProperty({
    description:
      'Structured context; for VALIDATION_FAILED, `fields` lists each bad field and why; for HOLD_LOST and HOLD_EXPIRED, ' +
      "`receivedAt` is when the instance received the request (ISO 8601, its own clock), to compare with the hold's `expiresAt`",
    type: 'object',
    additionalProperties: true,
  })
  details: Record<string, unknown>;
}

export class ErrorResponseDto {
  @ApiProperty({ description: 'The error', type: ErrorDetailDto })
  error: ErrorDetailDto;
}

/** Documents the error answers of a route, grouped by status, each with the API's error body. */
export function ApiErrors(...codes: ErrorCode[]): MethodDecorator & ClassDecorator {
  const byStatus = new Map<number, ErrorCode[]>();
  for (const code of [...codes, ErrorCode.DEPENDENCY_UNAVAILABLE, ErrorCode.RATE_LIMITED]) {
    const status = HTTP_STATUS[code];
    byStatus.set(status, [...(byStatus.get(status) ?? []), code]);
  }
  return applyDecorators(
    ApiExtraModels(ErrorResponseDto),
    ...[...byStatus].map(([status, list]) =>
      ApiResponse({ status, description: list.join(', '), schema: { $ref: getSchemaPath(ErrorResponseDto) } }),
    ),
  );
}
